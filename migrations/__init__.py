"""semkv-ledger's Alembic scripts, installed as the package ``ledger.migrations`` (``pyproject.toml``
maps it onto this folder) so that a wheel carries them; ``ledger/migrate.py`` finds them through the
import system. Nothing imports ``env.py`` or ``versions/``: Alembic loads them by path."""
