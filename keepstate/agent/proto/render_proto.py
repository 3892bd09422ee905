"""Render `.proto` source from the serialized FileDescriptorProto inside a protobuf-py `*_pb.py` module.

Development tool only (never imported by the agent). It reads the generated module as text, so it works on the
SDK's files without importing `e2b`:

    python -m keepstate.agent.proto.render_proto SDK/e2b/envd/process/process_pb.py > process/process.proto
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from protobuf.wkt.google.protobuf.descriptor_pb import (
    DescriptorProto,
    EnumDescriptorProto,
    FieldDescriptorProto,
    FileDescriptorProto,
)

# FieldDescriptorProto.Type numbers -> proto keywords (14 enum, 11 message use the type name instead).
_SCALARS = {
    1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 6: "fixed64", 7: "fixed32", 8: "bool",
    9: "string", 12: "bytes", 13: "uint32", 15: "sfixed32", 16: "sfixed64", 17: "sint32", 18: "sint64",
}
_LABEL_REPEATED = 3


def descriptor_bytes(pb_module_source: str) -> bytes:
    """The first bytes literal passed to `file_desc(...)` in a protobuf-py generated module."""
    for node in ast.walk(ast.parse(pb_module_source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "file_desc":
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, bytes):
                return first.value
    raise ValueError("no file_desc(b'...') call found")


def _type_ref(field: FieldDescriptorProto, package: str) -> str:
    if int(field.type) in _SCALARS:
        return _SCALARS[int(field.type)]
    name = field.type_name.lstrip(".")
    # Names inside our own package are written relative, as a human would.
    return name[len(package) + 1 :] if package and name.startswith(package + ".") else name


def _render_enum(enum: EnumDescriptorProto, indent: str) -> list[str]:
    out = [f"{indent}enum {enum.name} {{"]
    out += [f"{indent}  {v.name} = {v.number};" for v in enum.value]
    out.append(f"{indent}}}")
    return out


def _render_field(field: FieldDescriptorProto, msg: DescriptorProto, package: str) -> str:
    entries = {n.name: n for n in msg.nested_type if n.options is not None and n.options.map_entry}
    entry_name = field.type_name.rsplit(".", 1)[-1]
    if int(field.label) == _LABEL_REPEATED and entry_name in entries:
        key, value = entries[entry_name].field
        kind = f"map<{_type_ref(key, package)}, {_type_ref(value, package)}>"
    else:
        label = "repeated " if int(field.label) == _LABEL_REPEATED else ""
        label = "optional " if field.proto3_optional else label
        kind = label + _type_ref(field, package)
    return f"{kind} {field.name} = {field.number};"


def _render_message(msg: DescriptorProto, package: str, indent: str = "") -> list[str]:
    out = [f"{indent}message {msg.name} {{"]
    inner = indent + "  "
    for nested in msg.nested_type:
        if nested.options is None or not nested.options.map_entry:
            out += _render_message(nested, package, inner)
    for enum in msg.enum_type:
        out += _render_enum(enum, inner)
    real_oneofs: dict[int, list[FieldDescriptorProto]] = {}
    for field in msg.field:
        in_oneof = _has_oneof(field) and not field.proto3_optional
        if in_oneof:
            real_oneofs.setdefault(field.oneof_index, []).append(field)
    emitted: set[int] = set()
    for field in msg.field:
        if _has_oneof(field) and not field.proto3_optional:
            idx = field.oneof_index
            if idx in emitted:
                continue
            emitted.add(idx)
            out.append(f"{inner}oneof {msg.oneof_decl[idx].name} {{")
            out += [f"{inner}  {_render_field(f, msg, package)}" for f in real_oneofs[idx]]
            out.append(f"{inner}}}")
        else:
            out.append(f"{inner}{_render_field(field, msg, package)}")
    out.append(f"{indent}}}")
    return out


def _has_oneof(field: FieldDescriptorProto) -> bool:
    # Presence, not value: oneof index 0 is valid. Iterating a protobuf-py message yields its set fields.
    return any(f.name == "oneof_index" for f in field)


def render(fd: FileDescriptorProto) -> str:
    package = fd.package
    out = ['syntax = "proto3";', "", f"package {package};", ""]
    out += [f'import "{dep}";' for dep in fd.dependency]
    if fd.dependency:
        out.append("")
    for svc in fd.service:
        out.append(f"service {svc.name} {{")
        for m in svc.method:
            cs = "stream " if m.client_streaming else ""
            ss = "stream " if m.server_streaming else ""
            out.append(
                f"  rpc {m.name}({cs}{m.input_type.lstrip('.').removeprefix(package + '.')}) "
                f"returns ({ss}{m.output_type.lstrip('.').removeprefix(package + '.')});"
            )
        out += ["}", ""]
    for msg in fd.message_type:
        out += _render_message(msg, package)
        out.append("")
    for enum in fd.enum_type:
        out += _render_enum(enum, "")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m keepstate.agent.proto.render_proto PATH/TO/x_pb.py", file=sys.stderr)
        return 2
    fd = FileDescriptorProto.from_binary(descriptor_bytes(Path(argv[0]).read_text()))
    sys.stdout.write(render(fd))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
