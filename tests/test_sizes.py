import pytest

from tierd.errors import InvalidArgument
from tierd.sizes import format_size, parse_size


@pytest.mark.parametrize("text,value", [
    ("8GiB", 8 << 30), ("512 MiB", 512 << 20), ("1.5G", 1_500_000_000), ("4096", 4096), (123, 123),
    ("2tib", 2 << 40), ("0", 0), ("10kb", 10_000),
])
def test_parse(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-5", "5 parsecs", "1.2.3G", -1, True])
def test_parse_rejects(text):
    with pytest.raises(InvalidArgument):
        parse_size(text)


def test_format():
    assert format_size(512) == "512B"
    assert format_size(1536) == "1.5KiB"
    assert format_size(3 << 30) == "3.0GiB"
