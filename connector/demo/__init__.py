"""``semkv-ledger demo``: the product end to end on loopback (see :mod:`connector.demo.run`).

The demo is a composition root, like an operator's serving script: it starts the consumer daemon
and the recorded-stream publisher as processes (``semkv-ledger consume`` / ``publish``), and
reference-engine-harness processes that load the connector and the publisher bridge together.
It is the only code besides tests that uses ``consumer`` and ``connector`` side by side.
"""
