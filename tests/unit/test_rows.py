"""The typed projection rows bind to the tables by position: their fields must be the columns."""

import pytest

from ledger import rows, schema

PAIRS = [(rows.Engine, schema.EngineRow), (rows.Stream, schema.StreamRow), (rows.Source, schema.SourceRow),
         (rows.Block, schema.BlockRow), (rows.Donor, schema.DonorRow), (rows.DonorBlock, schema.DonorBlockRow),
         (rows.Lease, schema.LeaseRow), (rows.DeadLetter, schema.DeadLetterRow)]


@pytest.mark.parametrize(("row_type", "table_row"), PAIRS, ids=[p[0].__name__ for p in PAIRS])
def test_a_row_type_has_its_tables_columns_in_order(row_type, table_row) -> None:  # noqa: ANN001
    assert row_type.__struct_fields__ == tuple(c.name for c in table_row.__table__.columns)


def test_every_projection_table_has_a_row_type() -> None:
    typed = {table_row.__table__.name for _, table_row in PAIRS}
    assert {t.name for t in schema.PROJECTION_TABLES} - typed == {"counters"}  # counters are (engine, name) -> int
