"""GroupSpec / Layout validation, fingerprints, prefix rules per group kind, and block keys."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.backends.namespace import key_relpath
from tierkv.errors import InvalidArgument, LayoutError
from tierkv.keys import check_hashes, key_group, make_key, split_key
from tierkv.layout import GroupSpec, Layout


def full(block_bytes: int = 1024) -> GroupSpec:
    return GroupSpec(kind="full", block_bytes=block_bytes)


def hybrid() -> Layout:
    return Layout(tokens_per_block=16, groups=[
        GroupSpec(kind="full", block_bytes=65536),
        GroupSpec(kind="scratch", block_bytes=512),
        GroupSpec(kind="sliding_window", block_bytes=65536, window_blocks=4),
        GroupSpec(kind="recurrent", block_bytes=262144, states_per_request=2),
    ])


# ---- validation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, words", [
    ({"kind": "sliding_window", "block_bytes": 64}, "window_blocks"),
    ({"kind": "sliding_window", "block_bytes": 64, "window_blocks": 0}, "window_blocks"),
    ({"kind": "full", "block_bytes": 0}, "block_bytes"),
    ({"kind": "full", "block_bytes": -8}, "block_bytes"),
    ({"kind": "full", "block_bytes": 64, "window_blocks": 2}, "window_blocks"),
    ({"kind": "recurrent", "block_bytes": 64, "states_per_request": 0}, "states_per_request"),
    ({"kind": "mystery", "block_bytes": 64}, "kind"),
    ({"kind": "full", "block_bytes": 64, "colour": "red"}, "colour"),
])
def test_groupspec_refuses_invalid(kwargs: dict, words: str) -> None:
    with pytest.raises(LayoutError) as info:
        GroupSpec(**kwargs)
    assert isinstance(info.value, ValueError)
    assert words in str(info.value)


def test_groupspec_valid_kinds_build() -> None:
    assert GroupSpec(kind="sliding_window", block_bytes=8, window_blocks=3).window_blocks == 3
    assert GroupSpec(kind="recurrent", block_bytes=8, states_per_request=4).states_per_request == 4
    assert GroupSpec(kind="scratch", block_bytes=8).cacheable is False
    assert GroupSpec(kind="full", block_bytes=8).cacheable is True


@pytest.mark.parametrize("groups, words", [
    ([], "at least one group"),
    ([GroupSpec(kind="scratch", block_bytes=64)], "prefix-cacheable"),
    ([GroupSpec(kind="scratch", block_bytes=64), GroupSpec(kind="scratch", block_bytes=8)],
     "prefix-cacheable"),
])
def test_layout_refuses_groups(groups: list, words: str) -> None:
    with pytest.raises(LayoutError) as info:
        Layout(tokens_per_block=16, groups=groups)
    assert isinstance(info.value, ValueError)
    assert words in str(info.value)


def test_layout_refuses_nested_invalid_group_dict() -> None:
    with pytest.raises(LayoutError, match="window_blocks"):
        Layout(tokens_per_block=16, groups=[{"kind": "sliding_window", "block_bytes": 64}])
    with pytest.raises(LayoutError, match="block_bytes"):
        Layout(tokens_per_block=16, groups=[{"kind": "full", "block_bytes": 0}])


@pytest.mark.parametrize("tpb", [0, -16])
def test_layout_refuses_tokens_per_block(tpb: int) -> None:
    with pytest.raises(LayoutError, match="tokens_per_block"):
        Layout(tokens_per_block=tpb, groups=[full()])


def test_scratch_group_keeps_its_index() -> None:
    layout = hybrid()
    assert len(layout.groups) == 4
    assert layout.groups[1].kind == "scratch"
    assert layout.cacheable_groups == (0, 2, 3)
    assert layout.group(0).kind == "full"
    assert layout.group(2).kind == "sliding_window"
    assert layout.group(2).window_blocks == 4
    assert layout.group(3).kind == "recurrent"


@pytest.mark.parametrize("index", [1, 4, 100, -1, True])
def test_layout_group_refuses_scratch_and_unknown(index: int) -> None:
    with pytest.raises(InvalidArgument) as info:
        hybrid().group(index)
    assert isinstance(info.value, ValueError)


def test_layout_group_scratch_message_says_scratch() -> None:
    with pytest.raises(InvalidArgument, match="scratch"):
        hybrid().group(1)
    with pytest.raises(InvalidArgument, match="unknown group index 4"):
        hybrid().group(4)


# ---- fingerprint ---------------------------------------------------------------------------------

def test_fingerprint_is_32_hex_and_stable() -> None:
    fp = hybrid().fingerprint("m-bf16")
    assert re.fullmatch(r"[0-9a-f]{32}", fp)
    # built independently (from dicts rather than GroupSpec objects): same value
    again = Layout(tokens_per_block=16, groups=[
        {"kind": "full", "block_bytes": 65536},
        {"kind": "scratch", "block_bytes": 512},
        {"kind": "sliding_window", "block_bytes": 65536, "window_blocks": 4},
        {"kind": "recurrent", "block_bytes": 262144, "states_per_request": 2},
    ])
    assert again.fingerprint("m-bf16") == fp
    assert hybrid().fingerprint("m-bf16") == fp
    # a dump/reload round trip keeps it too
    assert Layout(**hybrid().model_dump()).fingerprint("m-bf16") == fp


def _variants() -> list[Layout]:
    base = [
        ("full", 65536, None, 1),
        ("scratch", 512, None, 1),
        ("sliding_window", 65536, 4, 1),
        ("recurrent", 262144, None, 2),
    ]

    def mk(groups: list[tuple], tpb: int = 16) -> Layout:
        return Layout(tokens_per_block=tpb, groups=[
            GroupSpec(kind=k, block_bytes=b, window_blocks=w, states_per_request=s)
            for k, b, w, s in groups
        ])

    out = [mk(base), mk(base, tpb=32)]
    out.append(mk([("full", 65535, None, 1), *base[1:]]))                       # block_bytes
    out.append(mk([base[0], base[1], ("sliding_window", 65536, 5, 1), base[3]]))  # window
    out.append(mk([*base[:3], ("recurrent", 262144, None, 3)]))                 # states_per_request
    out.append(mk([*base[:3], ("full", 262144, None, 1)]))                      # kind
    out.append(mk([base[0], *base[2:]]))                                        # scratch dropped
    out.append(mk([base[2], base[1], base[0], base[3]]))                        # order
    out.append(mk([*base, ("scratch", 8, None, 1)]))                            # group added
    out.append(mk([("full", 65536, None, 2), *base[1:]]))                       # spr on full
    return out


def test_fingerprint_differs_for_any_layout_change() -> None:
    fps = [lay.fingerprint("ns") for lay in _variants()]
    assert len(set(fps)) == len(fps)


def test_fingerprint_differs_by_namespace() -> None:
    lay = hybrid()
    names = ["", "ns", "ns ", "NS", "model-a-bf16", "model-a-fp8"]
    fps = [lay.fingerprint(n) for n in names]
    assert len(set(fps)) == len(names)
    assert lay.fingerprint() == lay.fingerprint("")


# ---- prefix rules per kind -----------------------------------------------------------------------

def test_blocks_needed_full() -> None:
    g = GroupSpec(kind="full", block_bytes=8)
    assert list(g.blocks_needed(0)) == []
    assert list(g.blocks_needed(1)) == [0]
    assert list(g.blocks_needed(5)) == [0, 1, 2, 3, 4]


def test_blocks_needed_sliding_window() -> None:
    g = GroupSpec(kind="sliding_window", block_bytes=8, window_blocks=3)
    assert list(g.blocks_needed(0)) == []
    assert list(g.blocks_needed(2)) == [0, 1]
    assert list(g.blocks_needed(3)) == [0, 1, 2]
    assert list(g.blocks_needed(7)) == [4, 5, 6]


def test_blocks_needed_recurrent_and_scratch() -> None:
    r = GroupSpec(kind="recurrent", block_bytes=8, states_per_request=2)
    assert list(r.blocks_needed(0)) == []
    assert list(r.blocks_needed(1)) == [0]
    assert list(r.blocks_needed(9)) == [8]
    s = GroupSpec(kind="scratch", block_bytes=8)
    for k in (0, 1, 9):
        assert list(s.blocks_needed(k)) == []


@given(k=st.integers(-3, 200), w=st.integers(1, 50))
@settings(max_examples=100, deadline=None)
def test_blocks_needed_window_property(k: int, w: int) -> None:
    g = GroupSpec(kind="sliding_window", block_bytes=8, window_blocks=w)
    got = list(g.blocks_needed(k))
    if k <= 0:
        assert got == []
    else:
        assert len(got) == min(k, w)
        assert got[-1] == k - 1
        assert got == list(range(got[0], k))


# ---- keys ----------------------------------------------------------------------------------------

def test_make_key_is_hash_plus_big_endian_group() -> None:
    h = bytes(range(32))
    for idx in (0, 1, 3, 255, 256, 65537, (1 << 32) - 1):
        key = make_key(h, idx)
        assert key == h + idx.to_bytes(4, "big")
        assert split_key(key) == (h, idx)
        assert key_group(key) == idx
    assert make_key(bytearray(b"\x01\x02"), 7) == b"\x01\x02\x00\x00\x00\x07"
    assert type(make_key(bytearray(b"\x01\x02"), 7)) is bytes


@pytest.mark.parametrize("h, idx", [
    (b"", 0), ("abc", 0), (123, 0), (None, 0), (b"x" * 1025, 0), (b"x", -1), (b"x", 1 << 32),
])
def test_make_key_refuses(h: object, idx: int) -> None:
    with pytest.raises(InvalidArgument):
        make_key(h, idx)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", [b"", b"\x00\x00\x00\x01", "abcdefgh", None])
def test_split_key_refuses(key: object) -> None:
    with pytest.raises(InvalidArgument):
        split_key(key)  # type: ignore[arg-type]


_PATH_OK = re.compile(r"[0-9a-fgk/]+")


@given(h=st.binary(min_size=1, max_size=1024), idx=st.integers(0, (1 << 32) - 1))
@settings(max_examples=300, deadline=None)
def test_key_roundtrip_and_safe_path(h: bytes, idx: int) -> None:
    key = make_key(h, idx)
    assert key == h + idx.to_bytes(4, "big")
    assert split_key(key) == (h, idx)
    p = key_relpath(key)
    assert _PATH_OK.fullmatch(p), p
    assert ".." not in p
    assert not p.startswith("/")
    assert "//" not in p and not p.endswith("/")
    name = p.rpartition("/")[2]
    # short keys are named by their hex; every name stays far below a file system's 255 bytes
    assert name == key.hex() if len(key) <= 64 else name.startswith("k") and len(name) == 65
    assert len(name) <= 128
    assert p.startswith(f"g{idx:08x}/")


@given(h1=st.binary(min_size=1, max_size=1024), h2=st.binary(min_size=1, max_size=1024),
       g1=st.integers(0, 1000), g2=st.integers(0, 1000))
@settings(max_examples=200, deadline=None)
def test_key_relpath_injective(h1: bytes, h2: bytes, g1: int, g2: int) -> None:
    k1, k2 = make_key(h1, g1), make_key(h2, g2)
    assert (key_relpath(k1) == key_relpath(k2)) == (k1 == k2)


def test_check_hashes_accepts_distinct_bytes() -> None:
    check_hashes([b"a", b"b", bytearray(b"c")])
    check_hashes((b"\x00" * 32, b"\x01" * 32))
    check_hashes([])


@pytest.mark.parametrize("hashes, words", [
    ([b"a", "b"], "hashes[1]"),
    ([b"a", 5], "hashes[1]"),
    ([b"a", None], "hashes[1]"),
    ([b"a", b""], "hashes[1]"),
    ([b"a", b"b", b"a"], "duplicate"),
    ([b"a", bytearray(b"a")], "duplicate"),
    (b"abcd", "single"),
    (bytearray(b"abcd"), "single"),
    ("abcd", "single"),
])
def test_check_hashes_refuses(hashes: object, words: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_hashes(hashes)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    assert words in str(info.value)
