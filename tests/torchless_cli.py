"""`python -m tests.torchless_cli ARGS...`: the kvstash command line in a process where torch and transformers cannot
be imported (tests.torchfree's finder), as on a machine where only `pip install 'kvstash[sidecar]'` ran. A sidecar
started this way (`SidecarProcess(module="tests.torchless_cli")`) fails on any path that still reaches for torch."""

from __future__ import annotations

import sys

from tests import torchfree


def main() -> None:
    torchfree.block()
    from ops.cli import main as cli  # noqa: PLC0415 - after the blocker: nothing of torch may load

    sys.argv = ["kvstash", *sys.argv[1:]]
    cli()


if __name__ == "__main__":
    main()
