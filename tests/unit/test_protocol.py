"""The attach protocol's parser: strict, bounded, and it never raises anything but ProtocolError."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputui.telemetry import protocol
from gputui.telemetry.protocol import ACTIONS, MAX_CLIENT_LINE, ProtocolError, clean, encode, parse_client, parse_server


def line(**record):
    return json.dumps({"v": protocol.VERSION, **record}).encode()


def test_valid_client_messages():
    assert parse_client(line(kind="hello", control=True)) == {"kind": "hello", "control": True}
    assert parse_client(line(kind="hello")) == {"kind": "hello", "control": False}
    assert parse_client(line(kind="control", id=3, action="set_amp", value="bf16")) == {
        "kind": "control",
        "id": 3,
        "action": "set_amp",
        "value": "bf16",
    }


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "a JSON object"),
        (line(kind="hello", v=1), "unsupported protocol version 1"),
        (json.dumps({"kind": "hello"}).encode(), "unsupported protocol version None"),
        (line(kind=7), "string 'kind'"),
        (line(kind="shutdown"), "unknown kind 'shutdown'"),
        (line(kind="hello", control="yes"), "'control' must be true or false"),
        (line(kind="control", id=-1, action="pause"), "'id' must be a non-negative integer"),
        (line(kind="control", id=True, action="pause"), "'id' must be a non-negative integer"),
        (line(kind="control", id=1, action="__import__('os').system('rm -rf /')"), "unknown action"),
        (line(kind="control", id=1, action=["pause"]), "unknown action"),
        (line(kind="control", id=1, action="set_amp", value={"$": 1}), "'value' must be"),
        (b"{" + b" " * MAX_CLIENT_LINE + b"}", "exceeds the 4096-byte limit"),
        (b"\xff\xfe", "not JSON"),
    ],
)
def test_invalid_client_messages_say_why(raw, reason):
    with pytest.raises(ProtocolError, match=reason.replace("(", r"\(").replace(")", r"\)").replace("$", r"\$")):
        parse_client(raw)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_bytes_only_protocol_errors(raw):
    try:
        message = parse_client(raw)
    except ProtocolError:
        return
    assert message["kind"] in ("hello", "control")  # the rare bytes that parse: a message, nothing else


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def verdict(data):
    """What parse_client must make of `data`, by the protocol's rules: the message, or None (refused)."""
    if data.get("v") != protocol.VERSION or isinstance(data.get("v"), bool):
        return None
    if data.get("kind") == "hello":
        control = data.get("control", False)
        return {"kind": "hello", "control": control} if isinstance(control, bool) else None
    ident, action, value = data.get("id"), data.get("action"), data.get("value")
    if data.get("kind") != "control" or type(ident) is not int or not 0 <= ident < 2**53:
        return None
    if not isinstance(action, str) or action not in ACTIONS or not isinstance(value, (str, bool, type(None))):
        return None
    return {"kind": "control", "id": ident, "action": action, "value": value}


@settings(max_examples=400, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={  # each field mostly one a message may have, so both verdicts are drawn often
            "v": st.just(protocol.VERSION) | json_values,
            "kind": st.sampled_from(["hello", "control"]) | json_values,
            "id": st.integers(-1, 2**53) | json_values,
            "action": st.sampled_from(sorted(ACTIONS)) | json_values,
            "value": json_values,
            "control": st.booleans() | json_values,
            "x": json_values,
        },
    )
)
def test_fuzz_objects_are_parsed_exactly_as_the_rules_say(data):
    """Accepted exactly when the rules accept it, as what they make of it; refused with a ProtocolError."""
    expected = verdict(data)
    if expected is None:
        with pytest.raises(ProtocolError):
            parse_client(json.dumps(data).encode())
    else:
        assert parse_client(json.dumps(data).encode()) == expected


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=6), st.booleans())
def test_a_line_returned_without_the_walk_is_what_the_walk_makes_of_it(data, ascii_only):
    """parse_server skips its walk over plain lines (printable ASCII, no risky number): never where the
    walk would have stripped a string or refused a number."""
    raw = json.dumps({**data, "v": 3, "kind": "step"}, ensure_ascii=ascii_only).encode()
    outcomes = []
    for parse in (parse_server, lambda line: protocol._printable(json.loads(line), 0, None)):
        try:
            outcomes.append(parse(raw))
        except ProtocolError:
            outcomes.append(ProtocolError)
    assert outcomes[0] == outcomes[1]


def test_encode_is_one_line_of_strict_json():
    raw = encode(clean({"kind": "step", "loss": float("nan"), "shape": (2, 3), "obj": object}))
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    data = parse_server(raw)
    assert data["v"] == protocol.VERSION and data["loss"] is None and data["shape"] == [2, 3]
    assert data["obj"].startswith("<class")


def test_deep_nesting_is_a_protocol_error_not_a_recursion_error():
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_client(b"[" * 2000)  # 2000 bytes: under the line limit, past the parser's recursion limit
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_server(b'{"v": 3, "kind": "hello", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")


def test_server_records_past_the_depth_limit_are_refused():
    deep = b'{"v": 3, "kind": "step", "x": ' + b"[" * 40 + b"]" * 40 + b"}"
    with pytest.raises(ProtocolError, match="deeper than 32"):
        parse_server(deep)


def test_server_strings_lose_escape_sequences_and_controls_keys_and_nested_values_too():
    escapes = "\x1b[2J\x1b]0;t\x07\x9b31m\r\x00\x7f"
    raw = json.dumps(
        {"v": 3, "kind": "hello", f"k{escapes}": [f"a{escapes}", {escapes: f"multi\nline\ttab{escapes}"}], "n": 3}
    ).encode()
    assert parse_server(raw) == {"v": 3, "kind": "hello", "k": ["a", {"": "multi line\ttab"}], "n": 3}


def test_a_version_error_quotes_at_most_a_few_characters():
    with pytest.raises(ProtocolError) as caught:
        parse_server(json.dumps({"v": "x" * 10_000, "kind": "hello"}).encode())
    assert len(str(caught.value)) < 100


def test_server_strings_keep_newlines_only_in_a_report_and_lose_bidi_overrides():
    raw = json.dumps(
        {"v": 3, "kind": "event", "name": "memory_summary", "text": "line 1\nline 2", "argv": ["a\nb", "\u202eevil"]}
    ).encode()
    assert parse_server(raw)["text"] == "line 1\nline 2"
    assert parse_server(raw)["argv"] == ["a b", "evil"]


@pytest.mark.parametrize("number", [b"Infinity", b"-Infinity", b"NaN", b"1e400", b"1" + b"0" * 400])
def test_server_numbers_python_cannot_handle_are_refused(number):
    with pytest.raises(ProtocolError):
        parse_server(b'{"v": 3, "kind": "step", "loss": ' + number + b"}")


@pytest.mark.parametrize("encoding", ["utf-16-be", "utf-16-le", "utf-32-be"])
def test_a_line_in_another_encoding_is_refused_not_guessed(encoding):
    """json.loads(bytes) guesses UTF-16/32: a UTF-16 line of ASCII bytes slipped a bidi override, NaN and a
    400-digit number past the plain-line check. Lines are UTF-8 JSON, nothing else."""
    for body in (
        '{"v": 3, "kind": "output", "lines": ["\u202eevil"]}',
        '{"v": 3, "kind": "step", "step": 1, "loss": NaN}',
        '{"v": 3, "kind": "step", "step": ' + "9" * 400 + "}",
    ):
        with pytest.raises(ProtocolError, match="not JSON"):
            parse_server(body.encode(encoding) + b"\n")
