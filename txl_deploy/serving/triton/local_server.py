"""Start a real `tritonserver` on this machine, without Docker: the binary that the `nvidia-pytriton` wheel bundles.

That wheel carries Triton 2.51 with only the Python backend, and one Python-backend stub per Python version. Three
things make it serve our Python-backend repositories (details in the repository README that `triton-repo` writes):

- the stub for *this* Python must sit in the backend directory, and load *this* interpreter's libpython
  (`LD_LIBRARY_PATH` = sysconfig LIBDIR: a pyenv Python is not the system one the stub was linked against);
- the stub embeds Python in isolated mode (PYTHONPATH ignored, base interpreter's site-packages): our model.py
  applies PYTHONPATH itself, so we pass this environment's site-packages there;
- `triton_python_backend_utils` imports numpy before model.py runs; the stub's sys.path starts with '' (the
  server's working directory), so we start the server in a folder holding a link to this environment's numpy.

Install the server files outside site-packages (the wheel pins numpy<2, which we do not want in the venv):
`pip install --no-deps --target .venv/triton nvidia-pytriton==0.7.0`. `TXL_TRITONSERVER` may name another
`tritonserver` binary (e.g. /opt/tritonserver/bin/tritonserver in NGC containers, whose backends are found beside it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from txl_deploy.errors import TxlError
from txl_deploy.serving.ports import free_ports

ENV_BINARY = "TXL_TRITONSERVER"
INSTALL_HINT = ("install the server files with `pip install --no-deps --target .venv/triton nvidia-pytriton==0.7.0` "
                f"(Triton 2.51, Python backend only) or set {ENV_BINARY} to a tritonserver binary")


class TritonLaunchError(TxlError):
    """tritonserver is missing, or did not come up."""


@dataclass
class TritonInstall:
    binary: Path
    backends: Path  # the folder holding python/ (and onnxruntime/, tensorrt/ where installed)
    stubs: Path | None = None  # pytriton's python_backend_stubs/<X.Y>/ folders
    libs: Path | None = None  # the wheel's bundled shared libraries


def _pytriton_dist(root: Path) -> TritonInstall | None:
    dist = root / "pytriton" / "tritonserver"
    binary = dist / "bin" / "tritonserver"
    if not binary.is_file():
        return None
    libs = root / "nvidia_pytriton.libs"
    return TritonInstall(binary, dist / "backends", dist / "python_backend_stubs", libs if libs.is_dir() else None)


def find_tritonserver(binary=None) -> TritonInstall:
    """The tritonserver to run: `binary` or $TXL_TRITONSERVER, else nvidia-pytriton's under <venv>/triton or in
    site-packages, else `tritonserver` on PATH. Raises TritonLaunchError with the install command otherwise."""
    explicit = binary or os.environ.get(ENV_BINARY)
    if explicit:
        path = Path(explicit)
        if path.is_dir():
            found = _pytriton_dist(path) or _pytriton_dist(path.parent)
            if found:
                return found
            path = path / "bin" / "tritonserver"
        if not path.is_file():
            raise TritonLaunchError(f"{path}: no tritonserver binary there")
        pytriton = _pytriton_dist(path.parents[3]) if len(path.parents) > 3 else None
        if pytriton and pytriton.binary == path:
            return pytriton
        return TritonInstall(path, path.parent.parent / "backends")
    candidates = [Path(sys.prefix) / "triton"]
    spec = importlib.util.find_spec("pytriton")  # only locates it; importing pytriton would pull in its deps
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]).parent)
    for root in candidates:
        found = _pytriton_dist(root)
        if found:
            return found
    on_path = shutil.which("tritonserver")
    if on_path:
        path = Path(on_path).resolve()
        return TritonInstall(path, path.parent.parent / "backends")
    raise TritonLaunchError(f"tritonserver not found: {INSTALL_HINT}")


def _prepare_workdir(install: TritonInstall, workdir: Path) -> tuple[Path, Path]:
    """backend dir with this Python's stub, and the server's working directory (numpy link). Returns both."""
    backends = install.backends
    if install.stubs is not None:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        stub = install.stubs / version / "triton_python_backend_stub"
        if not stub.is_file():
            raise TritonLaunchError(f"{install.stubs}: no Python-backend stub for Python {version}")
        backends = workdir / "backends"
        for entry in install.backends.iterdir():
            if entry.is_dir() and not entry.name.startswith("_"):
                (backends / entry.name).mkdir(parents=True, exist_ok=True)
                for f in entry.iterdir():
                    if f.is_file():
                        os.symlink(f, backends / entry.name / f.name)
        shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    cwd = workdir / "stub_site"
    cwd.mkdir(parents=True, exist_ok=True)
    numpy_spec = importlib.util.find_spec("numpy")
    if numpy_spec is not None and numpy_spec.origin:
        pkg = Path(numpy_spec.origin).parent
        for name in (pkg.name, pkg.name + ".libs"):
            src = pkg.parent / name
            if src.exists() and not (cwd / name).exists():
                os.symlink(src, cwd / name)
    return backends, cwd


def server_env(install: TritonInstall, pythonpath=None) -> dict:
    """Environment for tritonserver: this interpreter's libpython first, this environment's site-packages."""
    env = dict(os.environ)
    libdirs = []
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
    if libdir and ldlib.endswith(".so") and Path(libdir, ldlib).exists():
        libdirs.append(libdir)
    if install.libs is not None:
        libdirs.append(str(install.libs))
    if env.get("LD_LIBRARY_PATH"):
        libdirs.append(env["LD_LIBRARY_PATH"])
    if libdirs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libdirs)
    paths = list(pythonpath or []) + list(site.getsitepackages())
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
    return env


class TritonServer:
    """A tritonserver process on loopback (HTTP and gRPC on free ports), for tests and local serving.

    >>> with TritonServer(repo) as server:
    ...     client = TxlTritonClient(server.http_url)
    """

    def __init__(self, repository, *, binary=None, http_port: int | None = None, grpc_port: int | None = None,
                 log_path=None, pythonpath=None, exit_timeout: int = 5, extra_args=()):
        self.repository = Path(repository).resolve()
        self.install = find_tritonserver(binary)
        self._choose_ports = http_port is None and grpc_port is None  # ours to choose again if one is taken
        chosen = free_ports(2)
        self.http_port = http_port or chosen[0]
        self.grpc_port = grpc_port or chosen[1]
        self.log_path = Path(log_path) if log_path else None
        self.pythonpath = pythonpath
        self.exit_timeout = exit_timeout
        self.extra_args = list(extra_args)
        self.process = None
        self._workdir = None
        self._dirs = None
        self._log = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://127.0.0.1:{self.grpc_port}"

    def command(self, backends: Path) -> list[str]:
        return [
            str(self.install.binary), f"--model-repository={self.repository}", f"--backend-directory={backends}",
            "--http-address=127.0.0.1", "--grpc-address=127.0.0.1",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
            "--allow-metrics=false", "--pinned-memory-pool-byte-size=0",
            f"--exit-timeout-secs={self.exit_timeout}", *self.extra_args,
        ]

    def start(self, timeout: float = 120.0) -> "TritonServer":
        if self.process is not None and self.process.poll() is None:
            raise TritonLaunchError("this server is already running")
        if self._workdir is None:  # prepared once: a restart reuses the backend folder
            self._workdir = Path(tempfile.mkdtemp(prefix="txl-triton-"))
            self._dirs = _prepare_workdir(self.install, self._workdir)
        backends, cwd = self._dirs
        log_path = self.log_path or self._workdir / "tritonserver.log"
        self.log_path = log_path
        self._log = open(log_path, "ab")
        # A process group of its own (a Ctrl-C in the terminal does not reach it; stop() signals the group, stub
        # included), but this session: with the kernel's autogroup scheduling a new session is a CPU-share group
        # of its own, which on a busy machine would give the server more CPU than the process comparing with it.
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        for attempt in range(3):
            self.process = subprocess.Popen(
                self.command(backends), cwd=cwd, env=server_env(self.install, self.pythonpath),
                stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **group)
            try:
                self.wait_ready(timeout)
                break
            except TritonLaunchError:
                # A port chosen free can be taken by another process before the server binds it. On a first
                # start with ports of our choosing, choose again; a restart keeps its ports (clients hold them).
                if not (self._choose_ports and attempt < 2 and self.process.poll() is not None
                        and "in use" in self.log_tail().lower()):
                    raise
                self.http_port, self.grpc_port = free_ports(2)
        self._choose_ports = False
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise TritonLaunchError(f"tritonserver exited with code {self.process.returncode} before it was "
                                        f"ready; log {self.log_path}:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.2)
        self.stop()
        raise TritonLaunchError(f"tritonserver was not ready after {timeout:.0f} s; log {self.log_path}:\n"
                                f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = Path(self.log_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        keep = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("+", "|"))]
        return "\n".join(keep[-lines:])

    def stop(self, kill: bool = False):
        """SIGTERM (or SIGKILL with kill=True) the server's process group and wait for it to exit."""
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL if kill else signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=self.exit_timeout + 15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=15)
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, timeout: float = 120.0) -> "TritonServer":
        """Stop and start again on the same ports (conversations held by the old process are gone)."""
        self.stop()
        return self.start(timeout)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
