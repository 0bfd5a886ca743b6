"""The Gaussian-mixture toy: every check of toy_gaussian.py at quick sizes."""

import re

# -----------------------------------------------------------------------------
# The Gaussian-mixture toy: every check of toy_gaussian.py, quick sizes
# -----------------------------------------------------------------------------


def test_toy_gaussian_quick_passes_every_check(tmp_path, capsys):
    import toy_gaussian

    assert toy_gaussian.main(["--quick", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    passed = re.search(r"(\d+)/(\d+) passed", table)
    assert "FAIL" not in table and passed and passed.group(1) == passed.group(2) and int(passed.group(2)) >= 40
    assert len(list(tmp_path.glob("*.png"))) >= 5
