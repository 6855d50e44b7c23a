"""Two simulated hosts: network namespaces joined by a veth pair, and the README's recipe.

Each namespace has its own loopback, one end of the veth pair (``10.<n>.0.1`` / ``.2``,
default route over it) and, as on a stock host, an /etc/hosts (bind-mounted by
``ip netns exec`` from /etc/netns/NAME/hosts) where the hostname resolves to a loopback
address (Debian's ``127.0.1.1 <hostname>`` line). Needs root and iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IP_TIMEOUT_S = 10.0


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "not root: network namespaces and veth pairs need root; run the tests as root"
    if shutil.which("ip") is None:
        return "no `ip` command: install iproute2"
    return None


def _ip(*args: str) -> None:
    """Run ``ip ARGS``; raises RuntimeError with ip's own message when it fails."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if out.returncode:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()} (this machine "
                           "does not let root make network namespaces / veth pairs)")


@dataclass
class Host:
    """One namespace: its name, veth end and address."""

    netns: str
    veth: str
    address: str

    def argv(self, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *command]

    def link_bytes(self) -> tuple[int, int]:
        """(rx, tx) bytes of this host's veth end so far."""
        out = subprocess.run(self.argv(["cat", f"/sys/class/net/{self.veth}/statistics/rx_bytes",
                                        f"/sys/class/net/{self.veth}/statistics/tx_bytes"]),
                             check=True, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
        rx, tx = out.stdout.split()
        return int(rx), int(tx)


@dataclass
class TwoHosts:
    """Hosts ``a`` and ``b``; :meth:`start` makes them, :meth:`close` removes every trace
    (processes in the namespaces, namespaces, /etc/netns files)."""

    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    hosts: list[Host] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def ray_temp_dir(self) -> Path:
        """Ray's temp dir for this test's cluster (removed by :meth:`close`)."""
        return Path(f"/tmp/orch-ray-{self.tag}")

    @property
    def a(self) -> Host:
        return self.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts[1]

    def start(self) -> "TwoHosts":
        subnet = f"10.{200 + int(self.tag) % 50}.{int(self.tag) % 250}"
        self.hosts = [Host(f"orch-{side}-{self.tag}", f"o{side}{self.tag}", f"{subnet}.{i}")
                      for i, side in ((1, "a"), (2, "b"))]
        for host in self.hosts:
            _ip("netns", "add", host.netns)
            etc = Path("/etc/netns") / host.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
        _ip("link", "add", self.a.veth, "type", "veth", "peer", "name", self.b.veth)
        for host in self.hosts:
            _ip("link", "set", host.veth, "netns", host.netns)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.veth)
            _ip("-n", host.netns, "link", "set", host.veth, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")
            _ip("-n", host.netns, "route", "add", "default", "dev", host.veth)
        return self

    def spawn(self, host: Host, script: str, log: Path, env: dict[str, str]) -> subprocess.Popen:
        """Run a bash ``script`` in ``host``'s namespace (own process group), output to
        ``log``."""
        proc = subprocess.Popen(host.argv(["bash", "-c", script]), stdout=log.open("w"),
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, host: Host, argv: list[str], env: dict[str, str], timeout_s: float,
            stdin: str = "") -> str:
        """Run ``argv`` in ``host``'s namespace; its stdout (raises with stderr on failure)."""
        out = subprocess.run(host.argv(argv), input=stdin, capture_output=True, text=True,
                             env=env, cwd=ROOT, timeout=timeout_s)
        if out.returncode:
            raise RuntimeError(f"{argv} in {host.netns} failed ({out.returncode}):\n"
                               f"{out.stderr[-3000:]}")
        return out.stdout

    def close(self) -> None:
        """SIGTERM every process group started here (bounded), then SIGKILL whatever still
        runs in the namespaces, then delete them."""
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        # NOTE: 3 s, not more: `ray start --block` does not end on SIGTERM within 10 s (CI
        # spent the whole 10 s here); whatever still runs is SIGKILLed next, namespaces and all
        deadline = time.monotonic() + 3.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
        for host in self.hosts:
            _kill_netns_pids(host.netns)
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True,
                           timeout=IP_TIMEOUT_S)
            shutil.rmtree(Path("/etc/netns") / host.netns, ignore_errors=True)
        shutil.rmtree(self.ray_temp_dir, ignore_errors=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def _kill_netns_pids(netns: str) -> None:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                         timeout=IP_TIMEOUT_S)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class Recipe:
    """README's multi-node recipe, split by its comments: lines for every shell (``common``),
    the head node, every other node, and ``orch up`` on the head."""

    common: list[str]
    head: list[str]
    other: list[str]
    orch: list[str]


_GROUPS = {"every node": "common", "head node": "head", "every other node": "other",
           "on the head": "orch"}


def readme_recipe(readme: Path) -> Recipe:
    """Parse the fenced bash block of README's "## Multi-node" section.

    Raises:
        AssertionError: the block lost one of its four comment-led groups (update this
            parser together with the README).
    """
    text = readme.read_text()
    section = text[text.index("## Multi-node"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    groups: dict[str, list[str]] = {name: [] for name in _GROUPS.values()}
    current = None
    for line in block.splitlines():
        if line.startswith("#"):
            current = next((g for key, g in _GROUPS.items()
                            if line[1:].strip().startswith(key)), None)
        elif line.strip():
            assert current is not None, f"README recipe line outside a known group: {line}"
            groups[current].append(line.strip())
    missing = [name for name, lines in groups.items() if not lines]
    assert not missing, f"README multi-node recipe lost its groups {missing}: {block}"
    return Recipe(**groups)
