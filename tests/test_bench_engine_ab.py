"""``python -m benchmarks.engine_ab``: variants of the GEMM engine, loaded beside it.

A variant must be what its name says: gemm.py with the constants given (a constant gemm.py
lacks, or a malformed argument, is refused naming it), compiled as an instance of its own.
Run end to end on small shapes: a copy of the engine (``same:KC=256``) gives its bits, and a
variant whose K blocks are shorter (``kc64:KC=64``, partial sums rounded at other places) is
reported as giving other bits -- planted once: with the comparison of bits removed, the note
was missing and ``test_a_variant_with_other_bits_says_so`` failed.
"""
import pytest

from benchmarks import engine_ab
from benchmarks.engine_ab import parse_variant, variant_source

SOURCE = "KC = 256\nNC = 512      # a comment\nMC_MAX = 192\n"


def test_variants_parse():
    assert parse_variant("nopf:PREFETCH_B_ROWS=0,PREFETCH_C=False") == (
        "nopf", {"PREFETCH_B_ROWS": "0", "PREFETCH_C": "False"}, None)
    assert parse_variant("rows6:tile=6x32") == ("rows6", {}, (6, 32))


@pytest.mark.parametrize("text, named", [
    ("nocolon", "name:NAME=value"), ("x:KC", "NAME=value"), ("x:tile=6by32", "MRxNR"),
    ("x:kc=3", "not a module constant"), ("1x:KC=3", "name:NAME=value"),
])
def test_bad_variants_are_refused_naming_what_is_wrong(text, named):
    with pytest.raises(ValueError, match=named):
        parse_variant(text)


def test_a_variant_sets_exactly_its_constants():
    out = variant_source(SOURCE, {"NC": "1024", "KC": "384"})
    assert out == "KC = 384\nNC = 1024\nMC_MAX = 192\n"
    with pytest.raises(ValueError, match="no module constant NR_MAX"):
        variant_source(SOURCE, {"NR_MAX": "3"})


def test_the_real_gemm_has_the_constants_the_docstring_names():
    from npattn.kernels import tiles
    source = (tiles.HERE / "gemm.py").read_text()
    for name in ("KC", "NC", "MC_MAX", "PREFETCH_B_ROWS", "PREFETCH_C"):
        variant_source(source, {name: "1"})


def test_a_variant_with_other_bits_says_so(capsys):
    engine_ab.main(["same:KC=256", "kc64:KC=64", "--rounds", "1", "--shapes", "96x200x256"])
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 96×200·200×256"))
    assert "kc64: other bits" in row and "same: other bits" not in row, row
    assert row.count("×)") == 2, row       # a median (best) speedup per variant


def test_bad_arguments_exit_2(capsys):
    for argv in (["x:KC=3", "--rounds", "0"], ["x:KC=3", "--shapes", "4x5"], ["bad"]):
        with pytest.raises(SystemExit) as exit_info:
            engine_ab.main(argv)
        assert exit_info.value.code == 2
