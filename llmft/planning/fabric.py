"""Fast fabrics that must not fall back silently: is the NCCL network plugin a profile needs on this node?

NCCL loads a network plugin with dlopen(libnccl-net-<NCCL_NET_PLUGIN>.so): from LD_LIBRARY_PATH or the ld.so
cache, nowhere else. When it is not found NCCL logs one INFO line and runs over TCP sockets, 10x slower on EFA.
run_llm.slurm checks every node before launching (`python -m llmft.planning.allocation --fabric PROFILE`), then
tells NCCL to use the plugin by name (NCCL_NET), so a node that still cannot load it fails at start instead.

- aws-efa: the aws-ofi-nccl plugin NCCL_NET_PLUGIN names (the profile sets `ofi`: libnccl-net-ofi.so; releases
  that install libnccl-net-aws-ofi.so need NCCL_NET_PLUGIN=aws-ofi) and libfabric's library, both findable by the
  dynamic loader. AWS installs them under /opt/amazon/ofi-nccl/lib (or /opt/amazon/aws-ofi-nccl/lib) and
  /opt/amazon/efa/lib; a venv or container does not put them on the path.
- gcp-tcpx (a3-highgpu-8g, H100): Google's GPUDirect-TCPX plugin (libnccl-net.so, installed under
  /var/lib/tcpx/lib64) findable by the loader, and the receive-datapath-manager's (RxDM) socket directory
  (NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX, default /run/tcpx) on the node.
"""

from __future__ import annotations

import os
import subprocess
from typing import Callable, Mapping

OFI_INSTALL_DIRS = (
    "/opt/amazon/ofi-nccl/lib",
    "/opt/amazon/ofi-nccl/lib64",
    "/opt/amazon/aws-ofi-nccl/lib",
    "/opt/aws-ofi-nccl/lib",
)
LIBFABRIC = "libfabric.so"
LIBFABRIC_DIRS = ("/opt/amazon/efa/lib", "/opt/amazon/efa/lib64")
TCPX_PLUGIN = "libnccl-net.so"
TCPX_INSTALL_DIRS = ("/var/lib/tcpx/lib64", "/usr/local/tcpx/lib64")
TCPX_RXDM_DEFAULT = "/run/tcpx"
FABRICS = ("aws-efa", "gcp-tcpx")


def loader_finds(name: str, ld_library_path: str, ldconfig_text: str, exists: Callable[[str], bool]) -> str | None:
    """Where dlopen(name) would find a library: a directory on LD_LIBRARY_PATH, else the ld.so cache
    (`ldconfig -p`); None when it would not. (A library's versioned name counts: libfabric.so.1.)"""
    for directory in ld_library_path.split(":"):
        if directory and (exists(f"{directory}/{name}") or exists(f"{directory}/{name}.1")):
            return f"{directory}/{name}"
    for line in ldconfig_text.splitlines():
        line = line.strip()
        if line.startswith(name + " ") or line.startswith(name + ".1 "):
            return line.rsplit("=>", 1)[-1].strip()
    return None


def installed_in(name: str, dirs, exists: Callable[[str], bool]) -> str | None:
    return next((d for d in dirs if exists(f"{d}/{name}") or exists(f"{d}/{name}.1")), None)


def fabric_problem(
    fabric: str, env: Mapping[str, str], ldconfig_text: str, exists: Callable[[str], bool]
) -> str | None:
    """What this node lacks for the profile, with the fix; None when its plugin is findable."""
    path = env.get("LD_LIBRARY_PATH", "")
    if fabric == "aws-efa":
        missing = []
        plugin = env.get("NCCL_NET_PLUGIN", "").strip() or "ofi"
        name = plugin if "/" in plugin else f"libnccl-net-{plugin}.so"  # what NCCL dlopens
        found = exists(name) if "/" in plugin else loader_finds(name, path, ldconfig_text, exists)
        if not found:
            where = None if "/" in plugin else installed_in(name, OFI_INSTALL_DIRS, exists)
            missing.append(
                f"the aws-ofi-nccl plugin NCCL_NET_PLUGIN={plugin} loads ({name}) is not on the library path"
                + (
                    f"; it is installed in {where}: add it to LD_LIBRARY_PATH"
                    if where
                    else "; install aws-ofi-nccl (the EFA installer or a DLAMI has it) and add its lib directory to LD_LIBRARY_PATH"
                )
            )
        if not loader_finds(LIBFABRIC, path, ldconfig_text, exists):
            where = installed_in(LIBFABRIC, LIBFABRIC_DIRS, exists)
            missing.append(
                f"libfabric ({LIBFABRIC}) is not on the library path"
                + (
                    f"; it is installed in {where}: add it to LD_LIBRARY_PATH"
                    if where
                    else "; install the EFA software (aws-efa-installer)"
                )
            )
        return "; ".join(missing) or None
    if fabric == "gcp-tcpx":
        missing = []
        if not loader_finds(TCPX_PLUGIN, path, ldconfig_text, exists):
            where = installed_in(TCPX_PLUGIN, TCPX_INSTALL_DIRS, exists)
            missing.append(
                f"the GPUDirect-TCPX NCCL plugin ({TCPX_PLUGIN}) is not on the library path"
                + (
                    f"; it is installed in {where}: add it to LD_LIBRARY_PATH"
                    if where
                    else f"; install it (Google's nccl-plugin-gpudirecttcpx puts it in {TCPX_INSTALL_DIRS[0]})"
                )
            )
        rxdm = env.get("NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX", "").strip() or TCPX_RXDM_DEFAULT
        if not exists(rxdm):
            missing.append(
                f"no receive-datapath-manager (RxDM) socket directory {rxdm}: start Google's tcpx-daemon "
                "(RxDM) on each node, or set NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX to where it listens"
            )
        return "; ".join(missing) or None
    raise ValueError(f"unknown fabric {fabric!r}; known: {', '.join(FABRICS)}")


def ldconfig_cache() -> str:
    for exe in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            return subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            continue
    return ""


def fabric_missing(fabric: str, env: Mapping[str, str] | None = None) -> str | None:
    """fabric_problem on this node."""
    return fabric_problem(fabric, os.environ if env is None else env, ldconfig_cache(), os.path.exists)
