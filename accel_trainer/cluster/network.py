"""The network between machines: interfaces, routes and addresses, ports, reachability. Every probe is bounded.

What `accel-trainer launch` pins (the interface gloo/NCCL use, the local address torchrun advertises) and what
`accel-trainer check` probes come from here.
"""

import errno
import os
import socket
from dataclasses import dataclass

from ..errors import UserError

DEFAULT_PORT = 29500


def port_free(port: int, host: str = "") -> tuple[bool, str]:
    """Can this machine listen on `port`? (False, why) when busy or when `host` is not a local address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, int(port)))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False, f"port {port} is already in use on this machine (another run or service)"
            if e.errno == errno.EADDRNOTAVAIL:
                return False, f"{host} is not an address of this machine, so machine 0 cannot listen on it"
            return False, f"cannot listen on {host or '*'}:{port}: {e}"
    return True, f"port {port} is free"


def reachable(host: str, port: int, timeout_s: float = 5.0) -> tuple[bool, str]:
    """Is `host` reachable on `port` within `timeout_s`? A refused connection still proves the host is up."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return False, f"cannot resolve {host!r}: {e}. Check the name / use the IP address of machine 0."
    addr = infos[0][4]
    try:
        with socket.create_connection(addr[:2], timeout=timeout_s):
            return True, f"{host}:{port} accepts connections (machine 0 is listening)"
    except ConnectionRefusedError:
        return True, f"{host} is reachable; nothing listens on port {port} yet (start machine 0)"
    except TimeoutError:
        return False, (
            f"no answer from {host}:{port} within {timeout_s:.0f} s: wrong address, machine 0 down or cut off, or a "
            f"firewall dropping the port (open TCP {port} on machine 0)"
        )
    except OSError as e:
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
            return False, (
                f"no answer from {host}:{port} ({e.strerror}): nothing answers at that address on this network: "
                "wrong address, or machine 0 is down or cut off"
            )
        return False, f"cannot reach {host}:{port}: {e} (check the address and the route/interface)"


@dataclass
class Route:
    """How this machine reaches machine 0: the address and interface its traffic to `main_ip` leaves from."""

    main: str  # machine 0's address as configured (an IP or a host name)
    main_ip: str  # ... resolved here
    local_ip: str  # this machine's source address on the route to main_ip
    interface: str | None  # the interface that owns local_ip (None: not found)
    is_main: bool  # this machine owns main_ip (it is machine 0, or everything runs on loopback)

    def describe(self) -> str:
        via = f"interface {self.interface}" if self.interface else "an interface not found by name"
        shown = self.main if self.main == self.main_ip else f"{self.main} = {self.main_ip}"
        if self.is_main:
            return f"this machine owns machine 0's address {shown} ({via})"
        return f"this machine reaches machine 0's address {shown} from {self.local_ip} ({via})"


def local_addresses() -> dict[str, str]:
    """Every address of this machine (IPv4 and IPv6) -> the interface that owns it."""
    import psutil  # an accelerate dependency; the standard library cannot list addresses per interface

    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.setdefault(a.address.split("%")[0], name)
    return out


def is_loopback(addr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return addr == "localhost"


def cluster_addresses() -> list[tuple[str, str]]:
    """This machine's IPv4 addresses that another machine could reach, as (address, interface): on an interface
    that is up, neither loopback nor link-local (169.254.x)."""
    import psutil

    up = {name for name, st in psutil.net_if_stats().items() if st.isup}
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and name in up and not is_loopback(a.address):
                if not a.address.startswith("169.254."):
                    out.append((a.address, name))
    return out


def route_to(host: str, port: int = DEFAULT_PORT) -> Route:
    """The address and interface this machine uses to reach `host`. A UDP socket's connect() asks the kernel for
    the route and the source address without sending anything (what `ip route get` prints, without iproute2).
    UserError when the name does not resolve or no route leads there."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as e:
        raise UserError(
            f"cannot resolve machine 0's address {host!r} ({e}); use its IP address on the cluster network "
            "(main_process_ip / --main_process_ip)."
        ) from None
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            local = s.getsockname()[0]
    except OSError as e:
        shown = host if host == addr[0] else f"{host} ({addr[0]})"
        raise UserError(
            f"no route from this machine to machine 0's address {shown}: {e.strerror or e}. Check the "
            "address, and that this machine's network interface on that network is up (`ip addr`, `ip route`)."
        ) from None
    mine = local_addresses()
    return Route(host, addr[0], local, mine.get(local), addr[0] in mine)


def _default_route_interface() -> str | None:
    """The interface of this machine's default route (Linux /proc/net/route), or None."""
    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 7 and fields[1] == "00000000" and fields[7] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return None


def loopback_route(route: Route, machine_rank: int, environ=None) -> tuple[Route, str | None]:
    """A multi-machine route whose machine 0 address resolves to loopback here, made right or refused.

    The Debian default /etc/hosts maps the host name to 127.0.1.1, and SLURM scripts name machine 0 by host name:
    machine 0 would then pin gloo/NCCL to `lo` and announce 127.0.0.1, which c10d hands to every other machine as
    the store address. Machine 0 uses instead the address other machines can reach: the interface the user named
    in GLOO_SOCKET_IFNAME, else the name's own non-loopback address, else this machine's only one, else the one
    of the default route; several and none of these: refused, naming them. On machines 1..N-1 a name that
    resolves to loopback points at the machine itself: refused. An address given as loopback (127.0.0.1,
    localhost) is kept: several launches on one machine. Returns (route, a note for the user or None)."""
    if not is_loopback(route.main_ip) or is_loopback(route.main):
        return route, None
    seen = f"machine 0's address {route.main!r} resolves to {route.main_ip} on this machine (machine {machine_rank})"
    fix = "set main_process_ip (--main_process_ip) to machine 0's IP address on the cluster network, or fix /etc/hosts"
    if machine_rank != 0:
        raise UserError(f"{seen}: a loopback address, this machine itself, not machine 0. Fix: {fix} here.")
    environ = os.environ if environ is None else environ
    candidates = cluster_addresses()
    ip, why = None, ""
    wanted = environ.get("GLOO_SOCKET_IFNAME")
    named = [a for a in candidates if a[1] == wanted]
    try:
        own = {i[4][0] for i in socket.getaddrinfo(route.main, None, socket.AF_INET)} - {route.main_ip}
    except OSError:
        own = set()
    own_here = [a for a in candidates if a[0] in own]
    default = [a for a in candidates if a[1] == _default_route_interface()]
    if named:
        (ip, iface), why = named[0], f"GLOO_SOCKET_IFNAME={wanted}"
    elif len(own_here) == 1:
        (ip, iface), why = own_here[0], f"the other address of {route.main}"
    elif len(candidates) == 1:
        (ip, iface), why = candidates[0], "this machine's only non-loopback address"
    elif len(default) == 1:
        (ip, iface), why = default[0], "the default route's"
    if ip is None:
        have = ", ".join(f"{a} ({i})" for a, i in candidates) or "none"
        raise UserError(
            f"{seen}: a loopback address that the other machines cannot reach (the Debian `127.0.1.1 <name>` line "
            f"in /etc/hosts?), and which of this machine's addresses they reach is not clear (non-loopback: {have}). "
            f"Fix: {fix}, or set GLOO_SOCKET_IFNAME to the cluster network's interface."
        )
    note = (
        f"{seen}, a loopback address the other machines cannot reach (the Debian `127.0.1.1 <name>` /etc/hosts "
        f"line?); using {ip} ({iface}, {why}) instead. To choose, {fix}."
    )
    return Route(route.main, ip, ip, iface, True), note


def network_env(route: Route, environ=None) -> tuple[dict[str, str], dict[str, str]]:
    """The variables that make gloo, NCCL and torchrun use the route to machine 0: (to set, already set by the
    user -- theirs win). Without them gloo and torchrun use the address the host name resolves to, which on many
    clusters (containers, several NICs, a management network) is not the training network: gloo advertises
    127.0.0.1 and the other machines get "Connection refused"; c10d workers are handed machine 0's host name.

    GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME: the interface gloo / NCCL bind to ("=" is NCCL's exact match).
    PET_LOCAL_ADDR: torchrun's `--local_addr` (its `PET_` variables are its flags' defaults), which accelerate
    launch does not pass on: the address this machine's agent announces, and under c10d the MASTER_ADDR the
    workers get from machine 0."""
    environ = os.environ if environ is None else environ
    want = {"PET_LOCAL_ADDR": route.local_ip}
    if route.interface:
        want["GLOO_SOCKET_IFNAME"] = route.interface
        want["NCCL_SOCKET_IFNAME"] = "=" + route.interface
    new = {k: v for k, v in want.items() if not environ.get(k)}
    kept = {k: environ[k] for k in want if environ.get(k)}
    return new, kept


def host_role(rdzv_conf_value: str, backend: str, machine_rank: int, route: Route | None) -> str:
    """`rdzv_conf` with the c10d store's host role made explicit, unless the user set `is_host`.

    torch decides by comparing the endpoint with the host name's addresses, so machine 0 does not recognise its
    cluster address (10.77.0.1 is not what `vm` resolves to) and nobody hosts the store; on one host with two
    launches both would try. Machine 0 hosts when it owns the address; the others never do."""
    if backend != "c10d" or "is_host" in rdzv_conf_value:
        return rdzv_conf_value
    if machine_rank != 0:
        role = "is_host=0"
    elif route is not None and route.is_main:
        role = "is_host=1"
    else:
        return rdzv_conf_value  # machine 0 does not own the address (NAT, forwarding): leave it to torch
    return f"{rdzv_conf_value},{role}" if rdzv_conf_value else role


# ----------------------------------------------------------------------------------------------------------
# Launch command lines
