"""`qla-serve bench prefill --rows`: the named rows and the small batches (SMALL_ROWS, outside
`--rows all`) are accepted, anything else is refused by name before the benchmark looks for a GPU."""

from qla_serve.bench import prefill


def test_unknown_row_is_refused_by_name(capsys):
    assert prefill.main(["--rows", "1x512,64x512,9x9", "--heads", "2/8", "--impls", "qla16"]) == 2
    out = capsys.readouterr().out
    assert "--rows: unknown ['9x9']" in out and "1x512" in out


def test_small_rows_stay_out_of_all():
    """`--rows all` (the default, and the fits that read its rows) keeps its seven rows."""
    assert not set(prefill.SMALL_ROWS) & set(prefill.ROWS)
