"""What `import nixl` loads in this Python environment, and the one command that fixes it when
it cannot.

How NIXL's PyPI packages fit together (read from the `nixl` wheels 1.3.2, 1.4.1, 1.5.0 and 1.5.1
on PyPI: `nixl/__init__.py`, `nixl_meta_utils.py` and their METADATA):

* `nixl` is a meta package: NIXL's Python API (`from nixl._api import nixl_agent`, which vLLM,
  LMCache and this package use) comes from it, and it imports one runtime wheel, `nixl_cu12` or
  `nixl_cu13`, which holds libnixl.so and the plugin folder.
* It picks the runtime by the CUDA major version torch was built for (`torch.version.cuda`; 1.4.1
  and later read torch/version.py from disk without importing torch, 1.3.2 imports
  `torch.version` and so needs torch). With a CUDA build of torch it imports exactly
  `nixl_cu<major>` and fails ("detected CUDA 13 but nixl-cu13 is not installed") when that wheel
  is missing. Without torch, or with a CPU build, it takes the first of nixl_cu13, nixl_cu12
  that is installed.
* `nixl` requires both nixl-cu12 and nixl-cu13 (pinned to its own version), and each of those
  requires `torch` (no version). So `pip install nixl-cu12` in an environment without torch
  downloads torch, PyPI's default build of which is for CUDA 13 (torch 2.15.0: about 3 GB with
  its nvidia-* wheels). The fixes here therefore use `--no-deps` and name what is missing.

The check never imports NIXL or torch into this process: `import nixl` runs in a child
interpreter with the same flags and environment, and torch's CUDA version is read from
torch/version.py the way NIXL 1.4.1+ reads it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys

#: The NIXL release this project is built and tested against (ci/env.sh IUD_NIXL_WHEEL); the
#: version the fixes name when nothing of NIXL is installed yet.
NIXL_TESTED = "1.5.1"

#: CUDA majors NIXL publishes runtime wheels for (nixl-cu12, nixl-cu13 on PyPI).
NIXL_CUDA_MAJORS = (12, 13)

_PROBE = r"""
import json
try:
    import nixl
    print(json.dumps({"module": nixl._pkg.__name__}))
except BaseException as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}", "name": getattr(e, "name", None)}))
"""


@dataclasses.dataclass
class NixlEnv:
    python: str
    torch: str | None  # torch's version, None if torch is not installed
    torch_cuda: str | None  # torch.version.cuda ("13.2"), None for a CPU build or no torch
    packages: dict[str, str | None]  # installed NIXL pieces: pip name -> version (None: unknown)
    numpy: bool
    loads: str | None  # the runtime module `import nixl` loads, None if it fails
    import_error: str | None  # why `import nixl` fails
    problem: str | None = None  # one sentence: what is wrong
    fix: str | None = None  # the one command that fixes it
    note: str | None = None  # why the command looks the way it does

    @property
    def cuda_major(self) -> int | None:
        return int(self.torch_cuda.split(".")[0]) if self.torch_cuda else None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def describe(self) -> list[str]:
        """Lines for doctor: what is installed and what `import nixl` does with it."""
        if self.torch is None:
            torch = "torch: not installed (NIXL's `nixl` then takes nixl_cu13 or nixl_cu12, whichever is installed)"
        elif self.cuda_major is None:
            torch = (
                f"torch {self.torch}: a CPU build (NIXL's `nixl` then takes nixl_cu13 or nixl_cu12)"
            )
        else:
            torch = (
                f"torch {self.torch}: built for CUDA {self.torch_cuda}, so NIXL's `nixl` "
                f"loads nixl_cu{self.cuda_major}"
            )
        have = ", ".join(f"{k} {v or '(version unknown)'}" for k, v in self.packages.items())
        lines = [torch, f"NIXL packages: {have or 'none'}"]
        lines.append(
            f"import nixl: loads {self.loads}"
            if self.loads
            else f"import nixl: FAILS: {self.import_error}"
        )
        return lines

    def error_lines(self, rerun: str | None = None) -> list[str]:
        """The refusal (its first line without an "error: " prefix): what is wrong, the one
        command that fixes it, why it looks so, and what to run after it."""
        out = [f"{self.problem}"]
        if self.fix:
            out.append(f"fix: {self.fix}")
        if self.note:
            out.append(f"  ({self.note})")
        if rerun and self.fix:
            out.append(f"then run again: {rerun}")
        return out


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    except Exception:  # a broken dist-info: treat as unknown
        return None


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def torch_cuda_from_disk() -> tuple[str | None, str | None]:
    """(torch version, torch.version.cuda) read from torch/version.py without importing torch;
    (None, None) without torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return None, None
    version_py = os.path.join(os.path.dirname(spec.origin), "version.py")
    values: dict = {}
    try:
        with open(version_py, encoding="utf-8") as f:
            exec(compile(f.read(), version_py, "exec"), values)  # noqa: S102 (torch's own file)
    except Exception:
        pass
    version = _dist_version("torch") or values.get("__version__") or "(version unknown)"
    cuda = values.get("cuda")
    return str(version), (str(cuda) if cuda else None)


def probe_import(timeout: float = 120.0) -> tuple[str | None, str | None]:
    """Runs `import nixl` in a child interpreter like this one: (module it loaded, error)."""
    argv = [sys.executable]
    if sys.flags.isolated:
        argv.append("-I")
    else:
        if sys.flags.no_site:
            argv.append("-S")
        if sys.flags.ignore_environment:
            argv.append("-E")
    try:
        p = subprocess.run(argv + ["-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"`import nixl` did not finish within {timeout:.0f} s"
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            r = json.loads(line)
            return r.get("module"), r.get("error")
    tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
    return None, f"the interpreter exited with {p.returncode} while importing nixl: {tail}"


def _pip_in_plain_interpreter() -> bool:
    try:
        p = subprocess.run(
            [
                sys.executable,
                "-c",
                "import importlib.util as u, sys; sys.exit(u.find_spec('pip') is None)",
            ],
            capture_output=True,
            timeout=30,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0


def pip_command(packages: list[str]) -> str:
    """The command that installs `packages` into this interpreter's environment, without their
    dependencies."""
    py = shlex.quote(sys.executable)
    # pip as the command will see it: the interpreter started plainly (under -S, or with a
    # trimmed sys.path, this process may not see the venv's own site-packages, and with -S
    # sysconfig names the base Python's, not the venv's)
    if _present("pip") or _pip_in_plain_interpreter():
        return f"{py} -m pip install --no-deps {' '.join(packages)}"
    if shutil.which("uv"):  # uv-made venvs have no pip
        return f"uv pip install --python {py} --no-deps {' '.join(packages)}"
    return f"{py} -m ensurepip && {py} -m pip install --no-deps {' '.join(packages)}"


def check(probe: bool = True) -> NixlEnv:
    """What this environment has, what `import nixl` loads, and the fix when it fails."""
    torch, torch_cuda = torch_cuda_from_disk()
    packages = {}
    for pip_name, module in (
        ("nixl", "nixl"),
        ("nixl-cu12", "nixl_cu12"),
        ("nixl-cu13", "nixl_cu13"),
    ):
        if _present(module):
            packages[pip_name] = _dist_version(pip_name)
    env = NixlEnv(sys.executable, torch, torch_cuda, packages, _present("numpy"), None, None)
    if probe:
        env.loads, env.import_error = probe_import()

    # The version the fix names: the meta package's (it pins its runtime wheels), else an
    # installed runtime wheel's, else the tested one.
    version = next(
        (v for k in ("nixl", "nixl-cu13", "nixl-cu12") if (v := packages.get(k))), NIXL_TESTED
    )
    major = env.cuda_major
    if major is not None and major not in NIXL_CUDA_MAJORS:
        env.problem = (
            f"torch {torch} is built for CUDA {torch_cuda}, and NIXL publishes runtime "
            f"wheels for CUDA {' and '.join(map(str, NIXL_CUDA_MAJORS))} only "
            f"(nixl-cu12, nixl-cu13): NIXL's `nixl` cannot load here"
        )
        env.fix = None
        env.note = "install a torch built for CUDA 12 or 13 in this environment"
        return env
    if env.loads:
        return env

    missing = []
    if "nixl" not in packages:
        missing.append(f"nixl=={version}")
    if major is not None:
        if f"nixl-cu{major}" not in packages:
            missing.append(f"nixl-cu{major}=={version}")
    elif "nixl-cu12" not in packages and "nixl-cu13" not in packages:
        missing.append(f"nixl-cu12=={version}")
    if not env.numpy:
        missing.append("numpy")
    if not probe and not missing:
        return env

    why = env.import_error or "it would fail"
    if missing:
        have = ", ".join(f"{k} {v}" if v else k for k, v in packages.items()) or "none"
        if major is not None:
            need = f"torch {torch} is built for CUDA {major}, so `nixl` needs nixl-cu{major}"
        else:
            need = (
                "without a CUDA build of torch `nixl` takes nixl_cu13 or nixl_cu12 "
                "(nixl-cu12 runs without CUDA)"
            )
        env.problem = (
            f"`import nixl` fails in this Python environment ({why}). NIXL packages "
            f"installed: {have}; {need}."
        )
        env.fix = pip_command(missing)
        env.note = (
            "--no-deps: only what is missing; NIXL's wheels require torch and each "
            "other, which pip would otherwise resolve and download"
            if torch
            else "--no-deps: NIXL's wheels require torch, which pip would otherwise download "
            "(about 3 GB from PyPI); neither NIXL's storage backends nor this plugin "
            "need it"
        )
    elif env.import_error and "torch" in env.import_error and torch is None:
        env.problem = (
            f"`import nixl` fails ({why}): this `nixl` ({packages.get('nixl')}) "
            "imports torch (NIXL 1.3.x does; 1.4.1 and later do not)"
        )
        env.fix = f"{shlex.quote(sys.executable)} -m pip install torch"
        env.note = "about 3 GB; or use NIXL 1.4.1 or later, whose `nixl` works without torch"
    else:
        env.problem = f"`import nixl` fails in this Python environment: {why}"
        wheel = (
            f"nixl-cu{major}"
            if major is not None
            else ("nixl-cu13" if "nixl-cu13" in packages else "nixl-cu12")
        )
        env.fix = pip_command(["--force-reinstall", f"nixl=={version}", f"{wheel}=={version}"])
        env.note = "reinstalls NIXL's meta package and the runtime wheel it loads"
    return env
