"""The internal-plane flags every server process shares (node, coordinator, gateway) and the
client flags of the operator commands (`duet status`): one definition, so they never drift.

Reads them into runtime.plane.PlaneSecurity; an unusable secret or certificate is a usage
error (exit 2) before anything starts, never a silent start without it.
"""

from __future__ import annotations

import argparse

from duet.errors import UsageError

SECURITY_HELP = """\
The cluster secret authenticates every internal request (Authorization: Bearer) and the KV
transport's handshake. Without one, a process bound to loopback only starts with a warning;
bound to any other address it refuses to start unless --insecure is given. `duet up` generates
one (0600, $DUET_HOME/up/cluster.secret) and passes it to every process it starts."""


def add_secret_argument(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    g.add_argument(
        "--cluster-secret-file",
        default=None,
        metavar="PATH",
        help="file holding the cluster secret (mode 0600, ≥ 32 bytes); default: "
        "$DUET_CLUSTER_SECRET_FILE, else the secret itself in $DUET_CLUSTER_SECRET",
    )


def add_client_arguments(p: argparse.ArgumentParser) -> None:
    """What an operator command that calls the internal plane needs."""
    g = p.add_argument_group("cluster security")
    add_secret_argument(g)
    g.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="CA that signs the cluster's certificates (https)",
    )


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster security", SECURITY_HELP)
    add_secret_argument(g)
    g.add_argument(
        "--insecure",
        action="store_true",
        help="start without a cluster secret although listening on a non-loopback address "
        "(anyone who reaches it can use the internal API)",
    )
    g.add_argument(
        "--protect-metrics",
        action="store_true",
        help="GET /metrics needs the cluster secret too (default: open; /health always is)",
    )
    g.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="serve https with this certificate (chain)"
    )
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    g.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="CA that signs the other processes' certificates (trusted with the system's CAs)",
    )
    add_deadline_arguments(p)


def add_deadline_arguments(p: argparse.ArgumentParser) -> None:
    """A node's and a coordinator's read deadlines, generated from ReadDeadlines
    (runtime/read_deadlines.py); the gateway's are `[server]` settings of its config file."""
    from duet.config_flags import add_config_flags
    from runtime.read_deadlines import ReadDeadlines

    group = p.add_argument_group(
        "slow clients",
        "Deadlines for reading a request (slowloris): a connection past one is answered 408 and "
        "closed.",
    )
    add_config_flags(group, ReadDeadlines)


def read_deadlines(args: argparse.Namespace):
    """The flags as a ReadDeadlines; raises UsageError for a value out of range."""
    from duet.config_flags import config_kwargs
    from runtime.read_deadlines import ReadDeadlines

    d = ReadDeadlines(**config_kwargs(ReadDeadlines, args))
    problem = d.problem()
    if problem is not None:
        raise UsageError(f"--{problem.replace('_', '-')}")
    return d


def add_gateway_security_arguments(p: argparse.ArgumentParser) -> None:
    """The gateway's: it sends the secret to nodes and coordinators; its own API has API keys."""
    g = p.add_argument_group(
        "cluster security",
        "The cluster secret the gateway sends to nodes and coordinators "
        "(its own API is guarded by API keys).",
    )
    add_secret_argument(g)
    # /metrics carries team-labelled series (spend, tokens, refusals) on the public listener:
    # protected unless the operator opens it on purpose
    g.add_argument(
        "--protect-metrics",
        action="store_true",
        default=True,
        help="GET /metrics needs the cluster secret or the admin key (the default)",
    )
    g.add_argument(
        "--open-metrics",
        dest="protect_metrics",
        action="store_false",
        help="GET /metrics answers anyone: every team's name, spend, tokens and refusals become "
        "public (only for a listener no client can reach)",
    )
    g.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="serve https with this certificate (chain)"
    )
    g.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    g.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="CA that signs the nodes' and coordinators' certificates (trusted with the system's "
        "CAs)",
    )


def plane_security(args: argparse.Namespace):
    """The flags as a PlaneSecurity; raises UsageError for an unusable secret or TLS file."""
    from runtime.cluster_secret import SecretError, load_secret
    from runtime.plane import PlaneSecurity

    try:
        sec = PlaneSecurity(
            secret=load_secret(getattr(args, "cluster_secret_file", None)),
            protect_metrics=getattr(args, "protect_metrics", False),
            insecure=getattr(args, "insecure", False),
            tls_cert=getattr(args, "tls_cert", None),
            tls_key=getattr(args, "tls_key", None),
            tls_ca=getattr(args, "tls_ca", None),
        )
        sec.server_ssl()  # a bad certificate is the operator's error now, not at the first request
        sec.client_ssl()
    except SecretError as e:
        raise UsageError(str(e)) from None
    return sec
