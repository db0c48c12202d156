"""Ray for a study: a cluster joined (``--address``) or one of its own started here, and the checks
that keep Ray's dashboard, whose job API runs code on this machine, from being exposed by mistake.

Ray is imported inside the functions that start it: `search.study.runner` imports this module,
and `import search` imports the runner.
"""

from __future__ import annotations

import os
from typing import Any, TextIO

from search.hosts import check_bind_host, is_loopback_host
from trainers import PROJECT_ROOT
from trainers.errors import ConfigError

__all__ = ["init_ray", "in_checkout", "shipped_code", "check_ray_address", "check_dashboard_host", "dashboard_notes", "ray_token_auth_enabled",
           "dashboard_wanted", "DASHBOARD_FLAG", "DASHBOARD_ENV", "SHIP_EXCLUDES"]

DASHBOARD_FLAG = "--allow-remote-dashboard"
DASHBOARD_ENV = "LOCALITY_SEARCH_RAY_DASHBOARD"  # 0: a local cluster starts without Ray's dashboard

# Not shipped to a cluster's nodes with the code (on top of what .gitignore leaves out).
# gitignore patterns: the leading "/" anchors a folder at the project root ("results/" alone would
# also leave out the package search/results/)
SHIP_EXCLUDES = ["/.git/", "/results/", "/tests/", "/benchmarks/", "/dashboards/", "*.beton", "*.parquet", "*.journal"]


def check_ray_address(address: str, *, timeout_s: float = 5.0) -> None:
    """Fail fast on a ``host:port`` nobody listens on: Ray itself retries for minutes."""
    import socket

    if address == "auto" or "://" in address:
        return  # "auto" reads the local node's address file; ray:// is Ray Client's own protocol
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"--address {address!r}: expected HOST:PORT of a Ray head node (e.g. 10.0.0.5:6379), 'auto' or ray://HOST:10001")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ConfigError(
            f"--address {address}: no Ray head node answers there ({exc.strerror or exc}); check the address "
            "(`ray status` on the head node prints it) or leave --address out to start a local cluster"
        ) from None


def check_dashboard_host(dashboard_host: str, *, allow_remote: bool, address: str | None) -> None:
    """Before anything starts: a non-loopback dashboard needs ``allow_remote`` (the flag), and
    with ``address`` the cluster's head node has bound its dashboard already."""
    if address and not is_loopback_host(dashboard_host):
        raise ConfigError(
            f"--dashboard-host {dashboard_host}: applies only to the local cluster a run starts; with --address the "
            "head node's dashboard is already bound (`ray start --head --dashboard-host HOST` sets it)"
        )
    check_bind_host(dashboard_host, allow_remote=allow_remote, flag=DASHBOARD_FLAG, option="--dashboard-host",
                    what="Ray's dashboard, whose job API runs code on this machine")


def ray_token_auth_enabled() -> bool:
    """Whether this process's Ray uses token authentication (Ray >= 2.5x: on by default for a
    local cluster that ``ray.init()`` starts, unless ``RAY_AUTH_MODE=disabled``)."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # an older Ray without token authentication
        return False
    try:
        return bool(is_token_auth_enabled())
    except Exception:
        return False


def dashboard_notes(dashboard_host: str, url: str, out: TextIO) -> None:
    """After the URL line: how to log in when token auth is on; a warning when it is off on a
    non-loopback address."""
    if ray_token_auth_enabled():
        print("  (Ray token authentication is on: the dashboard asks for the token that `ray get-auth-token` prints)",
              file=out, flush=True)
    elif not is_loopback_host(dashboard_host):
        print(
            f"warning: the Ray dashboard listens on {dashboard_host} WITHOUT authentication (RAY_AUTH_MODE="
            f"{os.environ.get('RAY_AUTH_MODE', 'unset')}): anyone who reaches http://{url} can submit jobs that run code "
            "on this machine. Leave RAY_AUTH_MODE unset (Ray then requires a token) or bind 127.0.0.1",
            file=out, flush=True,
        )


def in_checkout() -> bool:
    """Whether this code runs from a checkout (its pyproject.toml beside the packages), not an install."""
    return (PROJECT_ROOT / "pyproject.toml").is_file()


def shipped_code() -> dict[str, Any]:
    """Ray's runtime_env for a cluster's nodes: the checkout as the working_dir (a zip of it,
    .gitignore'd files and results left out); installed (site-packages is no project to ship
    whole), the two packages through py_modules."""
    if in_checkout():
        return {"working_dir": str(PROJECT_ROOT), "excludes": SHIP_EXCLUDES}
    # both packages sit in PROJECT_ROOT (site-packages here); found by path, not imported (no cycle)
    return {"py_modules": [str(PROJECT_ROOT / "search"), str(PROJECT_ROOT / "trainers")],
            "excludes": ["__pycache__/", "*.pyc"]}


def dashboard_wanted() -> bool:
    """Whether a local cluster starts Ray's dashboard: yes unless ``LOCALITY_SEARCH_RAY_DASHBOARD=0``
    (a machine nobody watches, e.g. CI: the dashboard's processes take CPU at every start)."""
    return os.environ.get(DASHBOARD_ENV, "1") != "0"


def init_ray(address: str | None, dashboard_host: str, out: TextIO) -> None:
    """Join the cluster at ``address``, or start a local one whose dashboard binds
    ``dashboard_host`` (checked first by `check_dashboard_host`); nothing when Ray is up already."""
    import ray

    if ray.is_initialized():
        return
    init_args: dict[str, Any] = {
        "log_to_driver": False,  # trial output goes to the trial folders; errors go to the store
        "configure_logging": True,
        "logging_level": "WARNING",
    }
    if address:
        check_ray_address(address)
        # Ray ships this project to every node, so the nodes need only the Python packages, not
        # a checkout at the same path (docs/cluster.md)
        init_args.update(address=address, runtime_env=shipped_code())
    else:
        # "local": a cluster of our own, even when `ray start` left one running on this machine
        # (ray.init() would join that one, ignoring the dashboard settings); --address auto joins it.
        checkout = str(PROJECT_ROOT) if in_checkout() else None  # installed: importable as it is
        pythonpath = os.pathsep.join(filter(None, [checkout, os.environ.get("PYTHONPATH")]))
        init_args.update(address="local", include_dashboard=dashboard_wanted(), dashboard_host=dashboard_host,
                         runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        context = ray.init(**init_args)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        if not address:
            raise
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        auth = ""
        if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
            auth = ("; if the cluster uses token authentication (`ray start --head` turns it on by default), "
                    "run with RAY_AUTH_MODE=token and its token in ~/.ray/auth_token or RAY_AUTH_TOKEN")
        raise ConfigError(
            f"--address {address}: could not join that Ray cluster ({reason}); check the address "
            f"(ray status on the head node prints it) or leave --address out to start a local cluster{auth}"
        ) from None
    url = getattr(context, "dashboard_url", None)
    if url:
        print(f"Ray dashboard: http://{url}", file=out, flush=True)
        dashboard_notes(dashboard_host if not address else "127.0.0.1", url, out)
