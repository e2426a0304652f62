"""``python -m ledger …`` is ``semkv-ledger …`` (for subprocesses that cannot rely on PATH)."""

from ledger.cli import main

main()
