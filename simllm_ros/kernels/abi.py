"""The kernels' declared C ABI: each library's public header (`<library>_api.h` beside its source) declares what
it exports, and the Python bindings are checked against it.

Why: ctypes trusts whatever argtypes it is given. A C signature changed without its binding still loads and
then passes arguments in the wrong registers: wrong answers or a crash, at a run. The library's sources include
its header, so the compiler checks every definition against it; this module reads the same prototypes and
compares each binding's hand-written argtypes and restype with them, before the library is built (Loader.load)
and again where an entry is bound, raising AbiMismatch that names the function and what differs.

The headers keep one form this parser reads: `ret name(type name, ...);` (a declaration may span lines), comments
in /* */, `#include "other_api.h"` for entries another header declares (the pool's), and a comment that opens
with `[tag]` above an entry that only some builds define (`[amx]`, `[avx512]`: docs/kernels.md)."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re
from typing import Any, Mapping, Sequence

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))
HEADER_SUFFIX = "_api.h"

# What a binding may say for each kind of C parameter: scalars must be exactly their ctypes type (an int where a
# long is declared loses the high half), pointers a c_void_p (a struct pointer may also be a POINTER(Structure)).
_SCALARS = {"int": ctypes.c_int, "long": ctypes.c_long, "float": ctypes.c_float, "double": ctypes.c_double}
_POINTER, _STRUCT, _FUNCTION = "pointer", "struct pointer", "function pointer"
_PROTOTYPE = re.compile(r"^(?P<ret>[\w\s\*]+?)\s*\b(?P<name>simllm_\w+)\s*\((?P<params>.*)\)$", re.S)
_INCLUDE = re.compile(r'^\s*#\s*include\s+"(?P<name>\w+' + re.escape(HEADER_SUFFIX) + r')"', re.M)
_TAG = re.compile(r"^\[(\w+)\]")
# A wrapper's bindings: entry name -> (argtypes, restype)
Signatures = Mapping[str, tuple[Sequence[Any], Any]]


class AbiMismatch(Exception):
    """A binding disagrees with its library's header: a programming error, raised rather than falling back."""


@dataclasses.dataclass(frozen=True)
class Prototype:
    """One declared entry: its name, return kind, parameter kinds (a ctypes scalar type or a pointer kind) and the
    tag of the builds that define it ("" for every build)."""

    name: str
    restype: object
    params: tuple
    tag: str
    header: str


def header_path(library: str, source_dir: str = SOURCE_DIR) -> str:
    return os.path.join(source_dir, f"{library}{HEADER_SUFFIX}")


def _kind(text: str, where: str, named: bool = True):
    """A parameter's (named: its type, then maybe its name) or return value's kind from its C type: a ctypes scalar
    type, a pointer kind, or None (void)."""
    text = " ".join(text.replace("*", " * ").split())
    if "(" in text:
        return _FUNCTION
    words = [w for w in text.split() if w not in ("const", "volatile", "restrict")]
    if "*" in words:
        return _STRUCT if words[0] == "struct" else _POINTER
    if words in (["void"], []):
        return None
    base = " ".join(words[:-1] if named and len(words) > 1 else words)  # without the parameter's name
    if base == "void":
        return None
    if base not in _SCALARS:
        raise AbiMismatch(f"{where}: type {text!r} is not one kernels/abi.py reads (int, long, float, double, "
                          "a pointer or void)")
    return _SCALARS[base]


def _split_params(params: str) -> list[str]:
    """Parameters at parenthesis depth 0 (a function pointer's own parameters stay inside it)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(params):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append(params[start:i])
            start = i + 1
    out.append(params[start:])
    return [p.strip() for p in out if p.strip()]


def parse(path: str) -> dict[str, Prototype]:
    """Every `simllm_*` prototype of the header at path and of the `*_api.h` headers it includes."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    header = os.path.basename(path)
    found: dict[str, Prototype] = {}
    for inc in _INCLUDE.finditer(text):
        found.update(parse(os.path.join(os.path.dirname(path), inc.group("name"))))
    comment = ""  # the comment right above the next declaration
    for piece in re.split(r"(/\*.*?\*/|;)", text, flags=re.S):
        if piece.startswith("/*"):
            comment = piece[2:-2].strip()
            continue
        if re.search(r"^\s*#", piece, flags=re.M):  # a directive (guard, include) parts a comment from what follows
            comment = ""
            piece = re.sub(r"^\s*#.*$", "", piece, flags=re.M)
        piece = piece.strip()
        if not piece or piece == ";":
            continue
        if piece.startswith("struct ") and "(" not in piece:  # a forward declaration of a record
            comment = ""
            continue
        m = _PROTOTYPE.match(" ".join(piece.split()))
        if m is None:
            raise AbiMismatch(f"{header}: cannot read {piece[:80]!r} (one `ret simllm_name(type name, ...);` each)")
        name = m.group("name")
        where = f"{header}: {name}"
        if not comment:
            raise AbiMismatch(f"{where}: no comment above it saying why it is exported")
        params = [] if m.group("params").strip() == "void" else _split_params(m.group("params"))
        tag = _TAG.match(comment)
        found[name] = Prototype(name, _kind(m.group("ret"), where, named=False),
                                tuple(_kind(p, where) for p in params), tag.group(1) if tag else "", header)
        comment = ""
    return found


@functools.lru_cache(maxsize=None)
def declared(library: str, source_dir: str = SOURCE_DIR) -> dict[str, Prototype]:
    """The library's declared entries, by name (read once a process)."""
    return parse(header_path(library, source_dir))


def _spell(kind) -> str:
    if kind is None:
        return "void"
    return kind if isinstance(kind, str) else kind.__name__


def _binding_spell(t) -> str:
    return "None (void)" if t is None else getattr(t, "__name__", repr(t))


def _fits(kind, t) -> bool:
    """Whether the binding's ctypes type `t` passes a parameter (or return value) of the declared kind."""
    if kind in (_POINTER, _FUNCTION):
        return t is ctypes.c_void_p
    if kind == _STRUCT:
        return t is ctypes.c_void_p or (isinstance(t, type) and issubclass(t, ctypes._Pointer)
                                        and issubclass(t._type_, ctypes.Structure))
    return t is kind


def check(library: str, signatures: Signatures, source_dir: str = SOURCE_DIR) -> None:
    """Raise AbiMismatch unless every binding (name -> (argtypes, restype)) says what the library's header
    declares: the name, the number of arguments, each argument's type and the return type."""
    protos = declared(library, source_dir)
    header = os.path.basename(header_path(library, source_dir))
    for name, (argtypes, restype) in signatures.items():
        proto = protos.get(name)
        if proto is None:
            raise AbiMismatch(f"{name}: bound for the {library} library, but {header} does not declare it")
        if len(argtypes) != len(proto.params):
            raise AbiMismatch(f"{name}: the binding passes {len(argtypes)} arguments, {proto.header} declares "
                              f"{len(proto.params)}")
        for i, (kind, t) in enumerate(zip(proto.params, argtypes)):
            if not _fits(kind, t):
                raise AbiMismatch(f"{name}: argument {i + 1} is bound as {_binding_spell(t)}, {proto.header} "
                                  f"declares {_spell(kind)}")
        wrong = restype is not None if proto.restype is None else not _fits(proto.restype, restype)
        if wrong:
            raise AbiMismatch(f"{name}: returns {_binding_spell(restype)} in the binding, {proto.header} declares "
                              f"{_spell(proto.restype)}")


def bind(lib: ctypes.CDLL, library: str, signatures: Signatures, name: str):
    """The library's entry `name` typed as `signatures` says, after checking that against the header; None for an
    entry that only some builds define ([tag]) and this one does not."""
    check(library, {name: signatures[name]})
    try:
        fn = getattr(lib, name)
    except AttributeError:
        if declared(library)[name].tag:
            return None
        raise AbiMismatch(f"{name}: declared in {declared(library)[name].header} for every build, but the built "
                          f"{os.path.basename(lib._name)} does not export it") from None
    fn.argtypes, fn.restype = list(signatures[name][0]), signatures[name][1]
    return fn
