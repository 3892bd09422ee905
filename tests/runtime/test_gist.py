"""What a runsc failure says in an API error: a Go panic's message and the frames that raised it, not its stack."""

from keepstate.runtime.gvisor import _gist

PANIC = """checkpoint failed: checkpointing container "ks-1": encoding error: runtime error: invalid memory address \
or nil pointer dereference:
goroutine 606 [running]:
gvisor.dev/gvisor/pkg/state.safely.func1()
\tpkg/state/state.go:309 +0x16e
panic({0x11d0d60?, 0xc000ac5580?})
\tGOROOT/src/runtime/panic.go:783 +0x132
gvisor.dev/gvisor/pkg/sentry/mm.(*pma).saveFile(0x4198df?)
\tpkg/sentry/mm/save_restore.go:151 +0xf9
gvisor.dev/gvisor/pkg/sentry/mm.(*pma).StateSave(0xc0019eefe8, {{0xc001706008?, 0xc000e50bb8?}})
\tbazel-out/k8-opt/bin/pkg/sentry/mm/mm_state_autogen.go:377 +0x30
gvisor.dev/gvisor/pkg/state.(*encodeState).encodeStruct(0xc001706008, {0x13aeb20, 0xc0019eefe8, 0x199})
\tpkg/state/encode.go:536 +0x58e
gvisor.dev/gvisor/pkg/state.(*encodeState).encodeObject(0xc001706008)
\tpkg/state/encode.go:600 +0x1
"""


def test_a_panic_keeps_its_message_and_the_frames_under_it() -> None:
    gist = _gist(PANIC)
    assert gist.startswith("checkpoint failed: checkpointing container")
    assert "nil pointer dereference" in gist
    assert gist.endswith("at gvisor.dev/gvisor/pkg/sentry/mm.(*pma).saveFile < "
                         "gvisor.dev/gvisor/pkg/sentry/mm.(*pma).StateSave < "
                         "gvisor.dev/gvisor/pkg/state.(*encodeState).encodeStruct")
    assert "goroutine" not in gist and "0x" not in gist.split(" at ")[1]


def test_other_output_keeps_its_end() -> None:
    assert _gist("  a\n" + "x" * 900 + "END\n", limit=100) == ("x" * 97) + "END"
    assert _gist("no such container") == "no such container"
