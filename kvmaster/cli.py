"""``kvmaster`` command line.

``kvmaster master [--config FILE] [flags]`` runs a master; ``kvmaster ctl``
queries and administers one; ``kvmaster top`` watches one live;
``kvmaster keygen`` makes CURVE keys; ``kvmaster compat-shim install`` makes
``import mooncake.store`` load kvmaster's Mooncake facade.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from kvmaster.config import ConfigError, MasterConfig, add_cli_args, apply_config_file, \
    from_cli_args, to_toml


def _master(args: argparse.Namespace) -> int:
    try:
        config = from_cli_args(MasterConfig, args)
    except ValueError as exc:
        print(f"kvmaster master: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(to_toml(config))
        return 0
    from kvmaster.logging_setup import configure_logging_from_config
    from kvmaster._process import tune_gc
    from kvmaster.master import BindError, run_master

    configure_logging_from_config(config)
    from kvmaster._segment import segment_tag

    try:
        segment_tag()  # a bad KVMASTER_SEGMENT_TAG is a configuration error
    except ValueError as exc:
        print(f"kvmaster master: {exc}", file=sys.stderr)
        return 2

    def started(endpoint: str, metrics: str = "") -> None:
        print(f"kvmaster master listening on {endpoint}", flush=True)
        if config.ipc_path:
            print(f"kvmaster master also listening on ipc://{config.ipc_path}", flush=True)
        if metrics:
            print(f"kvmaster metrics on {metrics}", flush=True)

    tune_gc(config.gc_threshold)  # this process is the master's alone
    from kvmaster.errors import KVMasterError

    try:
        return run_master(config, started)
    except BindError as exc:
        print(f"kvmaster master: {exc.strerror}", file=sys.stderr)
        return 2
    except KVMasterError as exc:  # e.g. a --master-segment-size /dev/shm cannot hold
        print(f"kvmaster master: {exc}", file=sys.stderr)
        return 2


def _keygen(args: argparse.Namespace) -> int:
    from kvmaster import auth

    try:
        written = auth.keygen(args.dir, args.client, args.tenant)
    except (ValueError, FileExistsError) as exc:
        print(f"kvmaster keygen: {exc}", file=sys.stderr)
        return 2
    for p in written:
        print(p)
    return 0


def _ctl(args: argparse.Namespace) -> int:
    from kvmaster import ctl

    return ctl.run(args)


def _top(args: argparse.Namespace) -> int:
    from kvmaster import top

    return top.run(args)


_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|exc):`~?(?:[\w.]*\.)?([^`.]+)`")


def plain_doc(doc: str | None) -> str:
    """A module docstring as ``--help`` text: its paragraphs that point into the code
    (a Sphinx role such as ``:func:`kvmaster.x.f```) left out, reST literals as plain
    text, and a literal block's ``::`` as ``:``."""
    paras = [p for p in (doc or "").strip().split("\n\n") if not _ROLE.search(p)]
    return "\n\n".join(paras).replace("``", "").replace("::\n", ":\n").strip()


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None
               ) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that arguments no parser knows are refused by
    the deepest subcommand chosen, with that subcommand's own usage (argparse refuses
    them from the top parser, whose usage names only the subcommands).  Exits 2."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        here = parser
        while True:
            subs = [a for a in here._actions if isinstance(a, argparse._SubParsersAction)]
            chosen = getattr(args, subs[0].dest, None) if subs else None
            if chosen is None or chosen not in subs[0].choices:
                break
            here = subs[0].choices[chosen]
        here.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    from kvmaster import ctl, top

    parser = argparse.ArgumentParser(prog="kvmaster", description=plain_doc(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("master", help="run the master (ROUTER socket + shard actors)")
    p.add_argument("--config", metavar="FILE",
                   help="TOML file whose keys are these flags without the dashes "
                        "(eviction-ratio = 0.1); flags given here override it")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration as such a file and exit")
    add_cli_args(MasterConfig, p)
    p.set_defaults(func=_master)
    k = sub.add_parser("keygen", help="make CURVE keys: the master's pair, and a client's pair "
                                      "bound to a tenant")
    k.add_argument("dir", help="key directory (created if missing)")
    k.add_argument("--client", help="client name: writes clients/NAME.key{,_secret}")
    k.add_argument("--tenant", default="default", help="tenant the client's key is bound to")
    k.set_defaults(func=_keygen)
    c = sub.add_parser("ctl", help="query and administer a running master",
                       description=plain_doc(ctl.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ctl.add_arguments(c)
    c.set_defaults(func=_ctl)
    t = sub.add_parser("top", help="live view of a running master",
                       description=plain_doc(top.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_arguments(t)
    t.set_defaults(func=_top)
    from kvmaster.compat import shim

    s = sub.add_parser("compat-shim", help="install a mooncake package that resolves to "
                                           "kvmaster.compat (engines run unmodified)",
                       description=plain_doc(shim.__doc__),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    shim.add_arguments(s)
    s.set_defaults(func=shim.run)
    args = parse_args(parser, argv)
    if args.command == "master" and args.config:
        # The file's values become the defaults; parsing again lets flags win.
        try:
            apply_config_file(MasterConfig, p, args.config)
        except ConfigError as exc:
            print(f"kvmaster master: {exc}", file=sys.stderr)
            return 2
        args = parse_args(parser, argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
