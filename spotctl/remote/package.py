"""What the controller ships to a node: spotctl's own wheel, a wheelhouse of its pinned
dependencies, and the user's project directory.

Nothing on a node is ever installed by an unpinned public name:

- spotctl: a wheel of this very controller's code. From a source tree (an editable or
  checkout install) it is built with `pip wheel --no-deps --no-build-isolation` from a copy
  of the tree; from an installed distribution it is repacked from the installed files.
  Cached by content hash under `<SPOTCTL_HOME>/cache/package`.
- its dependencies (typer, rich, pydantic, fabric, platformdirs and what they need, with
  environment markers evaluated for this interpreter): each repacked into a wheel from the
  controller's installed files (exact versions; cached by name, version and tag), listed
  in `requirements.txt` as `name==version` pins. The node installs them with
  `pip --no-index --find-links`; only where a shipped binary wheel does not fit the node
  (another CPU or Python than the controller's) does pip fall back to its configured index,
  still for those exact pins.
- a node whose Python is older than some pins allow (Ubuntu 22.04's 3.10 against a 3.11
  controller: typer, platformdirs ... dropped 3.10) cannot take those exact versions. It
  installs spotctl's wheel (its own requirements, markers evaluated there, so tomli on
  3.10) and the top-level requirements of the shipped extras, with `constraints.txt`:
  the controller's exact versions, except `name<=version` for a dependency whose version
  drops a Python that spotctl still runs on (and TORCH_SPEC where the node has no torch
  of its own, so that no dependency pulls another build). pip takes the shipped wheels
  where they fit and, for the relaxed ones, the newest release up to the controller's
  that this Python takes, from the node's configured index.
- torch is never shipped: the node's venv reuses the image's (CUDA) torch when the image's
  python has one (`venv --system-site-packages`), else pip installs the pinned TORCH_SPEC.
- the project: the training script's directory (or `[train] project_dir`), honouring
  `.gitignore` (through `git ls-files` when it is a git work tree) and `.spotctlignore`.
  Files are uploaded one by one, so unchanged ones are skipped by the bootstrap's remote
  SHA-256 comparison.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import importlib.metadata as md
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotctl.errors import BootstrapError, SpecError

__all__ = [
    "NodePackage",
    "Project",
    "MIN_TORCH",
    "TORCH_DRIVER",
    "TORCH_SPEC",
    "node_package",
    "project_files",
]

# torch pinned: the bootstrap must never pull a newer (multi-GB) build onto a node.
TORCH_SPEC = "torch==2.13.0"
# The oldest NVIDIA driver (major) TORCH_SPEC's CUDA build runs on: torch 2.13.0's Linux
# wheels on PyPI are built with CUDA 13.0 (they require cuda-toolkit 13.0.3), which needs
# driver 580 or newer. A node with an older driver is stopped before the download.
TORCH_DRIVER = 580
# An image's torch older than this is not used: the node's venv does not see it and gets
# TORCH_SPEC. On 2.7 torchft cannot make its gloo process group and the torchrun engine's
# FSDP2 rescale and timed saves fail; 2.9 (the default images' torch) and newer pass.
MIN_TORCH = (2, 9)
# An image's name as the clouds' deep-learning images spell their torch and driver:
# GCP's families "pytorch-2-9-cu129-ubuntu-2404-nvidia-580", AWS's DLAMIs "... GPU PyTorch
# 2.9 (Ubuntu 24.04) ..." and their SSM parameters "...-pytorch-2.9-ubuntu-24.04/..."
_IMAGE_TORCH = re.compile(r"pytorch[-_ ]?(\d+)[.-](\d+)", re.I)
_IMAGE_DRIVER = re.compile(r"nvidia[-_](\d{3})(?!\d)", re.I)


def image_torch(name: str) -> str:
    """What `check` says of a worker image by its name: "" when the name says nothing (or a
    torch the nodes reuse); a note when its torch is older than MIN_TORCH (the nodes then
    download TORCH_SPEC); a SpecError when its NVIDIA driver is also older than
    TORCH_DRIVER (the nodes would stop at the bootstrap)."""
    m = _IMAGE_TORCH.search(name)
    if m is None or (int(m.group(1)), int(m.group(2))) >= MIN_TORCH:
        return ""
    old = f"{m.group(1)}.{m.group(2)}"
    floor = ".".join(map(str, MIN_TORCH))
    d = _IMAGE_DRIVER.search(name)
    if d is not None and int(d.group(1)) < TORCH_DRIVER:
        raise SpecError(
            f"{name}: its PyTorch {old} is older than {floor}, so each node would install "
            f"{TORCH_SPEC}, which needs NVIDIA driver {TORCH_DRIVER} or newer, and the "
            f"image's is {d.group(1)}: pick an image with PyTorch {floor} or newer")
    return (f"its PyTorch {old} is older than {floor}: each node downloads {TORCH_SPEC} "
            f"instead (several GB; needs NVIDIA driver {TORCH_DRIVER} or newer)")


# What a checkpoint_dir's scheme needs on the nodes besides spotctl (fsspec backends), as
# installed on the controller: `pip install 'spotctl[storage]'` there.
SCHEME_PACKAGES = {"s3": ("s3fs",), "gs": ("gcsfs",), "gcs": ("gcsfs",)}
# Never uploaded from a project directory, whatever the ignore files say.
ALWAYS_IGNORED = (".git", "__pycache__", "*.pyc", ".spotctl", ".venv", ".mypy_cache",
                  ".pytest_cache", ".ruff_cache")  # fmt: skip
# A project bigger than this is almost certainly data or a checkpoint someone forgot to
# ignore: refuse it with a line naming the biggest files rather than copy it to every node.
MAX_PROJECT_BYTES = 256 * 1024 * 1024

_lock = threading.Lock()
_memo: dict[str, NodePackage] = {}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class NodePackage:
    """spotctl's wheel and the wheelhouse of its pinned dependencies."""

    wheels: dict[str, bytes]  # file name -> content
    requirements: str  # `name==version` lines for the dependencies (spotctl excluded)
    spotctl_wheel: str  # its file name in `wheels`
    key: str  # content hash of all of the above: the node reinstalls when it changes
    torch_spec: str = TORCH_SPEC
    # pip's own wheel (in `wheels`): a node whose python has no ensurepip gets a venv
    # without pip and installs pip from this file ("" = not shipped)
    pip_wheel: str = ""
    # For a node whose Python some pins exclude (see the module docstring): the top-level
    # requirements besides spotctl's wheel (its extras' and the checkpoint backends'),
    # and the controller's versions as upper bounds
    older_requirements: str = ""
    older_constraints: str = ""
    _requires_python: dict[str, str] = field(default_factory=dict, repr=False)

    def requires_python(self, wheel: str) -> str:
        """A shipped wheel's Requires-Python ("" = any), from its METADATA."""
        if wheel not in self._requires_python:
            self._requires_python[wheel] = _wheel_requires_python(self.wheels[wheel])
        return self._requires_python[wheel]

    def fit(self, version: tuple[int, ...], machine: str = "") -> tuple[str, list[str]]:
        """Whether a node's Python (and machine) can install these wheels: (why it cannot,
        "" when it can; the wheels whose tags do not fit, which pip then fetches, at the
        same pinned version, from the node's own package index)."""
        need: dict[str, list[str]] = {}
        soft: list[str] = []
        for name in sorted(self.wheels):
            spec = self.requires_python(name)
            if not _allows(spec, version):
                need.setdefault(spec.replace(" ", ""), []).append(_pin(name))
            elif not _tags_fit(name, version, machine):
                soft.append(name)
        hard = "; ".join(f"{', '.join(pins)} require Python {spec}"
                         for spec, pins in sorted(need.items()))
        return (f"the shipped pins {hard}" if hard else ""), soft

    def own_fit(self, version: tuple[int, ...]) -> str:
        """Why spotctl's own wheel cannot go on this Python ("" when it can): a node whose
        Python only the dependencies' pins exclude still installs (with older releases of
        those), one that spotctl itself excludes does not."""
        spec = self.requires_python(self.spotctl_wheel)
        if not _allows(spec, version):
            return f"spotctl requires Python {spec.replace(' ', '')}"
        return ""

    @property
    def size(self) -> int:
        return sum(len(b) for b in self.wheels.values())

    def files(self, prefix: str = "pkg") -> dict[str, bytes]:
        """Relative remote path -> content, for the bootstrap's upload."""
        out = {f"{prefix}/{n}": b for n, b in sorted(self.wheels.items())}
        out[f"{prefix}/requirements.txt"] = self.requirements.encode()
        out[f"{prefix}/spotctl-wheel"] = (self.spotctl_wheel + "\n").encode()
        out[f"{prefix}/key"] = (self.key + "\n").encode()
        out[f"{prefix}/requirements-older.txt"] = self.older_requirements.encode()
        out[f"{prefix}/constraints.txt"] = self.older_constraints.encode()
        if self.pip_wheel:
            out[f"{prefix}/pip-wheel"] = (self.pip_wheel + "\n").encode()
        return out

    def summary(self) -> str:
        return f"spotctl package {self.key[:12]}: {len(self.wheels)} wheels, {_human(self.size)}"

    @classmethod
    def from_dir(cls, d: Path) -> NodePackage:
        """The package as `files()` laid it out in directory `d` (on a cloud head, which
        installs replacement nodes from what it was given)."""

        def text(name: str) -> str:
            p = d / name
            return p.read_text() if p.is_file() else ""

        wheels = {p.name: p.read_bytes() for p in sorted(d.glob("*.whl"))}
        own = text("spotctl-wheel").strip()
        if own not in wheels:
            raise BootstrapError(f"{d}: spotctl's wheel {own or '(unnamed)'} is missing")
        return cls(wheels=wheels, requirements=text("requirements.txt"), spotctl_wheel=own,
                   key=text("key").strip(), pip_wheel=text("pip-wheel").strip(),
                   older_requirements=text("requirements-older.txt"),
                   older_constraints=text("constraints.txt"))


@dataclass
class Project:
    """The user's project directory, as uploaded."""

    root: Path
    files: dict[str, bytes] = field(default_factory=dict)  # relative posix path -> content

    @property
    def size(self) -> int:
        return sum(len(b) for b in self.files.values())

    def summary(self) -> str:
        return f"project {self.root}: {len(self.files)} files, {_human(self.size)}"


def _wheel_requires_python(data: bytes) -> str:
    """A wheel's Requires-Python ("" = any), from its METADATA."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        meta = next((n for n in z.namelist()
                     if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), "")
        if not meta:
            return ""
        for line in z.read(meta).decode("utf-8", "replace").splitlines():
            if not line.strip():
                break  # end of the headers
            if line.lower().startswith("requires-python:"):
                return line.split(":", 1)[1].strip()
    return ""


def _drops_python(spec: str, own: str) -> bool:
    """Whether a dependency's Requires-Python excludes a Python 3 minor version that
    spotctl's own (`own`) allows, up to this controller's."""
    return any(_allows(own, (3, m)) and not _allows(spec, (3, m))
               for m in range(6, sys.version_info[1] + 1))


def _allows(spec: str, version: tuple[int, ...]) -> bool:
    """Whether a Requires-Python spec ("" = any) allows this Python version."""
    if not spec:
        return True
    full = ".".join(str(x) for x in (*version, 0, 0)[:3])
    return bool(_specifier(spec).contains(full, prereleases=True))


def _specifier(spec: str) -> Any:
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:  # pip vendors it; spotctl itself does not depend on it
        from pip._vendor.packaging.specifiers import (  # type: ignore[no-redef,assignment]
            SpecifierSet,
        )
    return SpecifierSet(spec)


def _pin(wheel: str) -> str:
    name, version = wheel.split("-")[:2]
    return f"{name}=={version}"


def _tags_fit(wheel: str, version: tuple[int, ...], machine: str) -> bool:
    """Whether a wheel's file-name tags fit this Python (and machine, when known)."""
    parts = wheel[: -len(".whl")].split("-")
    pys, abis, plats = (x.split(".") for x in parts[-3:])
    if machine and "any" not in plats and not any(p.endswith(machine) for p in plats):
        return False
    ver = tuple(version[:2])
    for p in pys:
        m = re.fullmatch(r"(cp|py)(\d)(\d*)", p)
        if not m:
            continue
        want = (int(m.group(2)), int(m.group(3) or 0))
        if not m.group(3):
            if ver[0] == want[0]:
                return True
        elif "abi3" in abis and ver[0] == want[0] and ver >= want:
            return True
        elif ver == want:
            return True
    return False


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


# ---- spotctl's wheel and its dependencies -------------------------------------------------


def _source_tree() -> Path | None:
    """The checkout this spotctl runs from (editable install), or None."""
    import spotctl

    root = Path(spotctl.__file__).resolve().parent.parent
    pp = root / "pyproject.toml"
    if pp.is_file() and re.search(r'(?m)^name\s*=\s*"spotctl"', pp.read_text()):
        return root
    return None


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    paths = [root / "pyproject.toml", root / "README.md"]
    for sub in ("spotctl", "templates"):
        for p in sorted((root / sub).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                paths.append(p)
    for p in paths:
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + b"\0")
            h.update(_sha256(p.read_bytes()).encode())
    return h.hexdigest()


def _build_from_source(root: Path, cache: Path) -> Path:
    key = _tree_hash(root)[:20]
    out = cache / f"spotctl-src-{key}"
    done = list(out.glob("spotctl-*.whl")) if out.is_dir() else []
    if done:
        return done[0]
    with tempfile.TemporaryDirectory(prefix="spotctl-wheel-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in ("pyproject.toml", "README.md", "LICENSE", "setup.cfg", "setup.py"):
            if (root / name).is_file():
                shutil.copy2(root / name, src / name)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
        shutil.copytree(root / "spotctl", src / "spotctl", ignore=ignore)
        if (root / "templates").is_dir() and not (src / "spotctl" / "templates").exists():
            # inside the package, where package-data ships them and _templates_dir looks
            shutil.copytree(root / "templates", src / "spotctl" / "templates", ignore=ignore)
        built = Path(tmp) / "out"
        r = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
             "--no-index", "-q", "-w", str(built), str(src)],
            capture_output=True, text=True,
        )  # fmt: skip
        wheels = list(built.glob("spotctl-*.whl"))
        if r.returncode != 0 or not wheels:
            tail = (r.stderr or r.stdout).strip().splitlines()
            raise BootstrapError(
                "building spotctl's wheel failed: " + (tail[-1] if tail else f"exit {r.returncode}")
            )
        out.mkdir(parents=True, exist_ok=True)
        tmp_dst = out / (wheels[0].name + ".tmp")
        shutil.copy2(wheels[0], tmp_dst)
        os.replace(tmp_dst, out / wheels[0].name)
        return out / wheels[0].name


def _wheel_tag(dist: md.Distribution) -> str:
    """The compressed tag set for the file name (py2-none-any + py3-none-any ->
    py2.py3-none-any), as the original wheel was named."""
    text = dist.read_text("WHEEL") or ""
    tags = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Tag:")]
    if not tags:
        return "py3-none-any"
    parts: list[list[str]] = [[], [], []]
    for t in tags:
        for i, p in enumerate(t.split("-", 2)):
            if p not in parts[i]:
                parts[i].append(p)
    return "-".join(".".join(p) for p in parts)


def _repack(dist: md.Distribution, cache: Path) -> Path:
    """A wheel of an installed distribution, from its RECORDed files (what pip installed)."""
    name = dist.metadata["Name"]
    version = dist.version
    tag = _wheel_tag(dist)
    fname = f"{re.sub(r'[-_.]+', '_', name)}-{version}-{tag}.whl"
    dst = cache / "deps" / fname
    if dst.is_file():
        return dst
    files = dist.files
    if not files:
        raise BootstrapError(
            f"cannot ship dependency {name}=={version}: its installed files are not recorded"
        )
    info_dir = next((f.parts[0] for f in files if f.parts[0].endswith(".dist-info")), "")
    if not info_dir:
        raise BootstrapError(f"cannot ship dependency {name}=={version}: no .dist-info")
    skip_info = {"RECORD", "INSTALLER", "REQUESTED", "direct_url.json"}
    record: list[str] = []
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(files, key=str):
            rel = f.as_posix()
            if rel.startswith("..") or "__pycache__" in f.parts or rel.endswith(".pyc"):
                continue  # scripts (pip regenerates them) and bytecode
            if f.parts[0] == info_dir and f.name in skip_info:
                continue
            path = Path(str(dist.locate_file(f)))
            if not path.is_file():
                continue
            data = path.read_bytes()
            info = zipfile.ZipInfo(rel, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (path.stat().st_mode & 0o777 | 0o100000) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{rel},sha256={digest.decode()},{len(data)}")
        record.append(f"{info_dir}/RECORD,,")
        z.writestr(f"{info_dir}/RECORD", "\n".join(record) + "\n")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, dst)
    return dst


def _requirement(raw: str) -> tuple[str, str, str]:
    """(name, extras, marker) of one Requires-Dist line."""
    req, _, marker = raw.partition(";")
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?", req)
    if not m:
        raise BootstrapError(f"cannot read requirement {raw!r}")
    return m.group(1), (m.group(2) or "").strip("[]"), marker.strip()


def _marker_ok(marker: str, extra: str) -> bool:
    if not marker:
        return True
    try:
        from packaging.markers import Marker
    except ImportError:  # pip vendors it; spotctl itself does not depend on it
        from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef,assignment]
    return bool(Marker(marker).evaluate({"extra": extra}))


def _closure(extras: tuple[str, ...], also: tuple[str, ...] = ()) -> list[md.Distribution]:
    """spotctl's installed dependencies and `also`'s (not spotctl, not torch), markers
    evaluated here."""
    out: dict[str, md.Distribution] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(n, ()) for n in also]
    root = md.distribution("spotctl")
    for raw in root.requires or []:
        name, wanted, marker = _requirement(raw)
        if any(_marker_ok(marker, x) for x in ("", *extras)):
            todo.append((name, tuple(e.strip() for e in wanted.split(",") if e.strip())))
    while todo:
        name, ex = todo.pop()
        key = _canon(name)
        if key in ("spotctl", "torch") or key in out:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError as e:
            raise BootstrapError(
                f"cannot ship dependency {name}: it is not installed on the controller"
            ) from e
        out[key] = dist
        for raw in dist.requires or []:
            n, e2, marker = _requirement(raw)
            if any(_marker_ok(marker, x) for x in ("", *ex)):
                todo.append((n, tuple(x.strip() for x in e2.split(",") if x.strip())))
    return [out[k] for k in sorted(out)]


def _extra_names(extras: tuple[str, ...]) -> list[str]:
    """The names spotctl's `extras` add to its own requirements (torch excluded: the node
    installs it apart, pinned)."""
    out: list[str] = []
    for raw in md.distribution("spotctl").requires or []:
        name, _, marker = _requirement(raw)
        if (marker and _canon(name) != "torch" and name not in out
                and any(_marker_ok(marker, x) for x in extras)
                and not _marker_ok(marker, "")):
            out.append(name)
    return out


def packages_for(checkpoint_dir: str) -> tuple[str, ...]:
    """The fsspec backend a checkpoint URI needs on the nodes (none for a path)."""
    scheme, sep, _ = checkpoint_dir.partition("://")
    return SCHEME_PACKAGES.get(scheme.lower(), ()) if sep else ()


def spotctl_wheel(cache: Path) -> Path:
    """This controller's spotctl as a wheel (built from its source tree, or repacked)."""
    root = _source_tree()
    if root is not None:
        return _build_from_source(root, cache)
    return _repack(md.distribution("spotctl"), cache)


def node_package(
    cache: Path, extras: tuple[str, ...] = (), also: tuple[str, ...] = ()
) -> NodePackage:
    """The package every node installs from: spotctl (with `extras`) and the distributions
    named in `also` (see packages_for), each with its dependencies as installed here.
    Built once per process and content."""
    for name in also:
        try:
            md.distribution(name)
        except md.PackageNotFoundError:
            raise BootstrapError(
                f"nodes need {name} for this checkpoint_dir, and it is not installed on the "
                "controller (pip install 'spotctl[storage]')"
            ) from None
    memo_key = f"{cache}|{','.join(extras)}|{','.join(also)}"
    root = _source_tree()
    if root is not None:
        memo_key += "|" + _tree_hash(root)
    with _lock:
        if memo_key in _memo:
            return _memo[memo_key]
        own = spotctl_wheel(cache)
        wheels = {own.name: own.read_bytes()}
        pins = []
        older = []
        own_python = _wheel_requires_python(wheels[own.name])
        for dist in _closure(extras, also):
            w = _repack(dist, cache)
            wheels[w.name] = w.read_bytes()
            pins.append(f"{dist.metadata['Name']}=={dist.version}")
            # exact, unless this version drops a Python spotctl still runs on: then the
            # newest release up to it that the node's Python takes
            drops = _drops_python(_wheel_requires_python(wheels[w.name]), own_python)
            older.append(pins[-1].replace("==", "<=", 1) if drops else pins[-1])
        requirements = "\n".join(pins) + "\n"
        # (torch is bounded on the node only when the node has none: an image's torch,
        # seen through the system site-packages, stays)
        older_constraints = "".join(p + "\n" for p in older)
        older_requirements = "".join(f"{n}\n" for n in (*_extra_names(extras), *also))
        pip_name = ""
        try:  # pip itself, for a node whose python lacks ensurepip (no python3-venv)
            pip_whl = _repack(md.distribution("pip"), cache)
            wheels[pip_whl.name] = pip_whl.read_bytes()
            pip_name = pip_whl.name
        except md.PackageNotFoundError:
            pass
        h = hashlib.sha256()
        for n in sorted(wheels):
            h.update(n.encode() + b"\0" + _sha256(wheels[n]).encode())
        h.update(requirements.encode() + TORCH_SPEC.encode())
        h.update(older_requirements.encode() + older_constraints.encode())
        pkg = NodePackage(wheels, requirements, own.name, h.hexdigest(), pip_wheel=pip_name,
                          older_requirements=older_requirements,
                          older_constraints=older_constraints)
        _memo[memo_key] = pkg
        return pkg


# ---- the project directory -------------------------------------------------------------


def _patterns(path: Path) -> list[str]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _ignored(rel: str, patterns: list[str] | tuple[str, ...], is_dir: bool = False) -> bool:
    """gitignore-style: last match wins, `!` re-includes, a pattern with no inner slash
    matches any path component, a trailing `/` matches directories only."""
    parts = rel.split("/")
    n_dirs = len(parts) if is_dir else len(parts) - 1  # leading components that are dirs
    result = False
    for raw in patterns:
        neg = raw.startswith("!")
        pat = raw[1:] if neg else raw
        dir_only = pat.endswith("/")
        pat = pat.rstrip("/")
        anchored = "/" in pat
        pat = pat.lstrip("/")
        if anchored:  # a path from the root: it or any directory above the file
            last = n_dirs if dir_only else len(parts)
            hit = any(fnmatch.fnmatchcase("/".join(parts[:i]), pat) for i in range(1, last + 1))
        else:
            comps = parts[:n_dirs] if dir_only else parts
            hit = any(fnmatch.fnmatchcase(c, pat) for c in comps)
        if hit:
            result = not neg
    return result


def _git_files(root: Path) -> list[str] | None:
    """Files git would keep (tracked + untracked, not ignored), relative to root; None when
    root is not inside a git work tree or git is missing."""
    if not shutil.which("git"):
        return None
    try:
        r = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
             "--exclude-standard", "--", "."],
            capture_output=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return sorted({p for p in r.stdout.decode(errors="surrogateescape").split("\0") if p})


# Never shipped to a node: where credentials live. A project holding one of these (not
# ignored) is refused, naming it.
CREDENTIALS = (".ssh", ".aws", ".gnupg", ".docker", ".kube", ".azure", ".netrc", ".pgpass",
               ".git-credentials", ".config/gcloud", ".config/gh", ".pypirc")
# system directories a training script has no business living in
_SYSTEM_DIRS = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/boot", "/dev", "/proc", "/sys")


def check_project_root(root: Path) -> None:
    """Refuse to ship a directory that is not a project: the file system's root, a home
    directory, a system directory, or one that holds spotctl's own state (the cluster
    secrets). One line naming it."""
    from spotctl.state import home as state_home

    root = root.resolve()
    homes = {Path.home().resolve()}
    if os.environ.get("HOME"):
        homes.add(Path(os.environ["HOME"]).resolve())
    fix = ("put the training script in a project directory of its own (everything in that "
           "directory is copied to every node)")
    if root == Path(root.anchor):
        raise BootstrapError(f"project directory {root} is the file system's root: {fix}")
    if root in homes:
        raise BootstrapError(f"project directory {root} is your home directory: {fix}")
    if any(root == Path(d) or Path(d) in root.parents for d in _SYSTEM_DIRS):
        raise BootstrapError(f"project directory {root} is a system directory: {fix}")
    state = state_home().resolve()
    if state == root or root in state.parents:
        raise BootstrapError(f"project directory {root} holds spotctl's state ({state}), "
                             f"with the cluster secrets: {fix}")


def _credential(rel: str) -> str | None:
    """The credential path `rel` is or lies under, if any."""
    parts = rel.split("/")
    for c in CREDENTIALS:
        cp = c.split("/")
        for i in range(len(parts) - len(cp) + 1):
            if parts[i : i + len(cp)] == cp:
                return "/".join(parts[: i + len(cp)])
    return None


def project_files(root: Path, max_bytes: int = MAX_PROJECT_BYTES) -> Project:
    """The project directory's files to upload (see the module docstring). Refused with one
    line: a directory that is no project (check_project_root) or one holding credentials
    that are not ignored."""
    root = root.resolve()
    if not root.is_dir():
        raise BootstrapError(f"project directory {root} does not exist")
    check_project_root(root)
    spotctlignore = _patterns(root / ".spotctlignore")
    listed = _git_files(root)
    if listed is None:
        gitignore = _patterns(root / ".gitignore")
        listed = []
        for dirpath, dirnames, filenames in os.walk(root):
            rel_dir = Path(dirpath).relative_to(root).as_posix()
            keep = []
            for d in sorted(dirnames):
                rel = d if rel_dir == "." else f"{rel_dir}/{d}"
                if not _ignored(rel, [*ALWAYS_IGNORED, *gitignore], is_dir=True):
                    keep.append(d)
            dirnames[:] = keep
            for f in sorted(filenames):
                rel = f if rel_dir == "." else f"{rel_dir}/{f}"
                if not _ignored(rel, gitignore):
                    listed.append(rel)
    files: dict[str, bytes] = {}
    total = 0
    sizes: list[tuple[int, str]] = []
    for rel in listed:
        if _ignored(rel, [*ALWAYS_IGNORED, *spotctlignore]):
            continue
        cred = _credential(rel)
        if cred is not None:
            raise BootstrapError(
                f"project directory {root} holds credentials ({cred}), which would be copied "
                f"to every node: move the training script to a directory of its own, or add "
                f"{cred} to .spotctlignore")
        p = root / rel
        if p.is_symlink() or not p.is_file():
            continue  # links could point anywhere on the controller: not shipped
        data = p.read_bytes()
        files[rel] = data
        total += len(data)
        sizes.append((len(data), rel))
    if total > max_bytes:
        biggest = ", ".join(f"{r} ({_human(n)})" for n, r in sorted(sizes, reverse=True)[:3])
        raise BootstrapError(
            f"project directory {root} is {_human(total)} (limit {_human(max_bytes)}); "
            f"add data and checkpoints to .spotctlignore (biggest: {biggest})"
        )
    return Project(root, files)
