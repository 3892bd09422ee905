from __future__ import annotations

import pytest

from keepstate.store import (
    CheckpointMeta,
    CorruptObject,
    EventRef,
    HostFacts,
    IncompatibleCheckpoint,
    check_restorable,
    ids,
    manifest,
)
from keepstate.store.manifest import FileEntry, Run


def sample() -> tuple[CheckpointMeta, list[FileEntry]]:
    meta = CheckpointMeta(session_id="s", parent_id="PARENT", template_id="t", template_digest="sha256:1",
                          runsc_release="20240729", cpu_features=("avx2",), sizes={"memory": 3},
                          event=EventRef(3, "ff"), labels={"k": "v"})
    zero = ids.zero_chunk_id(65536)
    files = [FileEntry("pages.img", "memory", 0o600, 65536 * 10 + 5,
                       (Run(zero, 65536, 10), Run(ids.digest(b"tail"), 5))),
             FileEntry("rootfs/a", "file", 0o644, 0, ())]
    return meta, files


def test_round_trip() -> None:
    meta, files = sample()
    data = manifest.to_bytes(meta, files)
    m = manifest.decode(ids.hexdigest(data), data)
    assert m.meta == meta and list(m.files) == files and m.size == 65536 * 10 + 5
    assert m.files[0].chunk_count == 11
    assert [o for o, _ in m.files[0].chunk_offsets()] == [0, 655360]


def test_damage_and_inconsistency_are_refused() -> None:
    meta, files = sample()
    data = manifest.to_bytes(meta, files)
    damaged = bytearray(data)
    damaged[-3] ^= 1
    with pytest.raises(CorruptObject):
        manifest.decode(ids.hexdigest(data), bytes(damaged))
    wrong_size = [FileEntry("x", "file", 0o644, 99, (Run(ids.digest(b"a"), 1),))]
    bad = manifest.to_bytes(meta, wrong_size)
    with pytest.raises(CorruptObject, match="add up"):
        manifest.decode(ids.hexdigest(bad), bad)


@pytest.mark.parametrize("name", ["", "/etc/passwd", "../x", "a/../../b", "a//b", "./a"])
def test_unsafe_names_are_refused(name: str) -> None:
    meta, _ = sample()
    with pytest.raises(ValueError):
        manifest.to_bytes(meta, [FileEntry(name, "file", 0o644, 0, ())])


def test_refs_are_self_checking() -> None:
    ref = manifest.encode_ref("CK1", "ab" * 32)
    assert manifest.decode_ref("CK1", ref) == "ab" * 32
    for i in range(len(ref)):
        damaged = bytearray(ref)
        damaged[i] ^= 0x01
        with pytest.raises(CorruptObject):
            manifest.decode_ref("CK1", bytes(damaged))
    with pytest.raises(CorruptObject):
        manifest.decode_ref("CK2", ref)


def test_restore_is_refused_on_an_incompatible_host() -> None:
    meta, files = sample()
    data = manifest.to_bytes(meta, files)
    m = manifest.decode(ids.hexdigest(data), data)
    check_restorable(m, HostFacts("20240729", "sha256:1", frozenset({"avx2", "sse4_2"})))
    with pytest.raises(IncompatibleCheckpoint) as info:
        check_restorable(m, HostFacts("20250101", "sha256:2", ()))
    message = str(info.value)
    assert "runsc release 20240729" in message and "sha256:1" in message and "avx2" in message


def test_checkpoint_ids_sort_by_time() -> None:
    a, b = ids.new_checkpoint_id(), ids.new_checkpoint_id()
    assert len(a) == 26 and a[:8] <= b[:8]
    ids.check_checkpoint_id(a)
