import pytest

from gputui.units import format_bytes, parse_size


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
