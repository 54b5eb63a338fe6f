"""What `up` tells the user from a node's bootstrap output (templates/bootstrap.sh's lines)."""

from __future__ import annotations

from spotctl.remote.bootstrap import _old_torch_note, worker_fallback_note


def test_an_old_image_torch_is_named_with_its_path_even_with_spaces() -> None:
    out = ("spotctl: /opt/my envs/py 3/bin/python has torch 2.7.1+cu128, older than 2.9: "
           "installing torch==2.13.0\nspotctl: deps installed\n")
    assert _old_torch_note(out) == ("the image's torch (/opt/my envs/py 3/bin/python) is "
                                    "2.7.1+cu128, older than 2.9: it got torch==2.13.0 instead")
    assert _old_torch_note("spotctl: deps present\n") == ""


def test_the_workers_fallback_names_the_user_and_why() -> None:
    out = ("spotctl: workers run as ubuntu: spotctl-train can write /opt/conda/lib/python3.11/"
           "site-packages, which the root agent's python loads\nspotctl-result worker=none\n")
    assert worker_fallback_note(out) == (
        "training workers run as ubuntu, not [train] run_as (spotctl-train can write "
        "/opt/conda/lib/python3.11/site-packages, which the root agent's python loads): "
        "they can read the node's credential")
    assert worker_fallback_note("spotctl: workers run as spotctl-train\n") == ""
