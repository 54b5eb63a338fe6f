"""reduce_dtype=torch.bfloat16 on both engines, with real torchrun (and the head's torchft
Lighthouse): the gradient every rank's optimizer sees is the mean of the ranks' gradients
each rounded to bfloat16, and without it the exact fp32 mean. The two samples' gradients
differ only below bfloat16's precision, so the two answers differ (1.0 against
1 + 3 * 2^-11), and a reduction left in fp32, or done in bf16 without asking, fails."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.elastic.ft_harness import FtReplicas

SCRIPT = Path(__file__).with_name("reduce_dtype_train.py")
FP32_MEAN = 1 + 3 * 2.0**-11  # (1 + 2^-10 + 1 + 2^-9) / 2, exact in fp32
BF16_MEAN = 1.0  # each rounds to 1.0 in bfloat16 (8 significant bits)
STEPS = 4


def _grads(c: FtReplicas, names: list[str], nproc: int) -> list[tuple[int, float]]:
    import json

    out = []
    for n in names:
        for k in range(nproc):
            p = c.tmp / f"{n}.rd.jsonl" if k == 0 else c.tmp / f"{n}.rd.jsonl.{k}"
            out += [(r["ranks"], r["grad"]) for r in map(json.loads, p.read_text().splitlines())]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torchrun", "torchft"])
def test_gradients_are_reduced_in_the_dtype_asked(tmp_path: Path, engine: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if engine == "torchft" and importlib.util.find_spec("torchft") is None:
        pytest.skip("torchft is not installed (the 'ft' extra)")
    # torchft: the first quorum waits for both replicas (as a new cluster's does)
    monkeypatch.setenv("SPOTCTL_FT_START_REPLICAS", "2")
    # torchrun: one group of two ranks; torchft: two one-process replicas
    names, nproc = (["g"], 2) if engine == "torchrun" else (["r0", "r1"], 1)
    for dtype, want in (("bf16", BF16_MEAN), ("", FP32_MEAN)):
        d = tmp_path / (dtype or "fp32")
        d.mkdir()
        c = FtReplicas(d, STEPS, engine=engine, script=SCRIPT, nproc=nproc, delay=0.0)
        try:
            for n in names:
                monkeypatch.setenv("RD_DTYPE", dtype)
                monkeypatch.setenv("RD_LOG", str(d / f"{n}.rd.jsonl"))
                c.start(n)
            codes = c.finish(names)
            assert codes == dict.fromkeys(names, 0), "".join(c.output(n) for n in names)
            grads = _grads(c, names, nproc)
        finally:
            c.stop()
        two = [g for ranks, g in grads if ranks == 2]
        assert len(two) >= STEPS, grads  # every step of both ranks (or replicas) logged
        assert all(g == want for g in two), (dtype or "fp32", grads)


def test_a_reduce_dtype_spotctl_cannot_use_is_refused() -> None:
    import torch

    from spotctl.elastic import _reduce_dtype

    assert _reduce_dtype(None) is None and _reduce_dtype(torch.float32) is None
    assert _reduce_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="reduce_dtype must be torch.bfloat16, torch.float16"):
        _reduce_dtype(torch.int8)
