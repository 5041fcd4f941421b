import pytest

from gputui.units import (
    format_bytes,
    format_bytes_short,
    format_count,
    format_duration,
    format_figure,
    format_pieces,
    parse_size,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("512MiB", 512 * 2**20),
        ("512 MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("8g", 8 * 2**30),
        ("2kib", 2048),
        ("100", 100),
        ("100b", 100),
        (".5GiB", 2**29),
        (4096, 4096),
        ("1TiB", 2**40),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12 parsecs", "-5MiB", "0", "MiB", "1.2.3G", True, 0, -1])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(
    "n, text",
    [
        (None, "n/a"),
        (0, "0 B"),
        (812, "812 B"),
        (1536, "1.50 KiB"),
        (23.4 * 2**20, "23.4 MiB"),
        (79.6 * 2**30, "79.6 GiB"),
        (512 * 2**30, "512 GiB"),
        (-3 * 2**20, "-3.00 MiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    "n, text",
    [
        (None, "n/a"),
        (0, "0B"),
        (812, "812B"),
        (12 * 2**10, "12.0K"),
        (812 * 2**20, "812M"),
        (9.25 * 2**30, "9.25G"),
        (80 * 2**30, "80.0G"),
        (2 * 2**40, "2.00T"),
        (-3 * 2**20, "-3.00M"),
    ],
)
def test_format_bytes_short(n, text):
    assert format_bytes_short(n) == text


@pytest.mark.parametrize(
    "seconds, text",
    [
        (None, "--:--"),
        (0, "00:00"),
        (59.9, "00:59"),
        (303, "05:03"),
        (3600, "1:00:00"),
        (3729, "1:02:09"),
        (86399, "23:59:59"),
        (90061, "1d01:01:01"),
        (360000, "4d04:00:00"),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    "n, text", [(0, "0"), (812, "812"), (999.4, "999"), (12_345, "12.3k"), (124_400_000, "124.4M"), (1.5e9, "1.5B")]
)
def test_format_count(n, text):
    assert format_count(n) == text


@pytest.mark.parametrize(
    "value, unit, spec, text",
    [(None, "°C", "", "n/a"), (61, "°C", "", "61°C"), (598.4, " W", ".0f", "598 W"), (0, "%", "", "0%")],
)
def test_format_figure(value, unit, spec, text):
    assert format_figure(value, unit, spec) == text


@pytest.mark.parametrize("v", [0.903, 2.13e-12, 6.24e-05, -2.13e-12, 123456789.0, 1.5, 0.0, -0.5])
def test_a_chart_axis_label_fits_its_gutter_and_keeps_its_magnitude(v):
    from gputui.tui.chart import axis_number

    text = axis_number(v)
    assert len(text) <= 7
    assert float(text) == pytest.approx(v, rel=0.5)  # cut to "9.03e-0" it would read 9.03


@pytest.mark.parametrize(
    "pieces, text",
    [
        ((8, 2, 16), "8x2=16"),
        ((39, 2, 48), "39+9=48"),  # the screenshot said "39 × 2 = 48"
        ((11, 6, 64), "11x5+9=64"),
        ((32, 1, 20), "20x1=20"),  # an epoch's short last batch: one piece of what there is
        ((47, 1, 48), "48x1=48"),  # a rest below the floor joined the piece before it
    ],
)
def test_a_batch_is_written_as_its_pieces_add_up(pieces, text):
    assert format_pieces(*pieces) == text
    assert format_pieces(*pieces, sums=False) == text.split("=")[0]  # a plan row's label: no total


def test_the_remedies_line_spaces_the_pieces():
    assert format_pieces(39, 2, 48, spaced=True) == "39 + 9 = 48"
    assert format_pieces(8, 2, 16, spaced=True) == "8 × 2 = 16"
