"""Single-edit mutants of a Python file, found over its AST and applied to its text (spec/mutation.md).

Invariant: a file's mutants depend on its text alone (walk order: by
position, then kind), so ``sample(mutants, n, seed)`` picks the same mutants
on every machine (MUT-1). Each mutant is one edit of the kinds mutmut makes
(MUT-2): delete a simple statement (it becomes ``pass``), flip a comparison,
swap ``and``/``or``, drop a ``not``, flip ``True``/``False``, add one to an
int, swap an arithmetic operator (also in ``+=``), swap ``break``/``continue``.
Never mutated: docstrings and ``...`` bodies, annotations, asserts (our own invariants),
imports, ``__slots__``/``__all__``, ``if TYPE_CHECKING:`` blocks, strings,
f-strings, and lines marked ``# pragma: no mutate``. An edit that does not
parse or leaves the node's syntax tree unchanged is not a mutant.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Iterator
from dataclasses import dataclass

_COMPARE_SWAP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
_ARITH_SWAP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.Mod: ast.Div, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.LShift: ast.RShift, ast.RShift: ast.LShift,
}
_DELETABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Delete)
_NO_MUTATE = "pragma: no mutate"


@dataclass(frozen=True)
class Mutant:
    """One edit: bytes [start, end) of the file's text become ``replacement``."""

    path: str
    line: int
    kind: str
    before: str
    after: str
    start: int
    end: int
    replacement: str

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.replacement.encode() + source[self.end :]

    def describe(self) -> str:
        return f"{self.path}:{self.line} {self.kind}: `{self.before}` -> `{self.after}`"


def _one_line(text: str, limit: int = 70) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _is_docstring(node: ast.stmt) -> bool:
    """A docstring, or the ``...`` body of a Protocol method: text, not code."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
        return False
    return isinstance(node.value.value, str) or node.value.value is Ellipsis


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _names_dunder_list(node: ast.stmt) -> bool:
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return any(isinstance(t, ast.Name) and t.id in ("__slots__", "__all__") for t in targets)


class _Finder(ast.NodeVisitor):
    """Collects (node, kind, replacement text) for every mutable spot, skipping what the module docstring lists."""

    def __init__(self) -> None:
        self.edits: list[tuple[ast.stmt | ast.expr, str, str]] = []

    # --- what is skipped -------------------------------------------------------------------------
    def visit_Assert(self, node: ast.Assert) -> None:
        return

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return

    def visit_Import(self, node: ast.Import) -> None:
        return

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        return

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node):
            self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> None:
        return  # its annotation

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._body_of(node.args, node.body)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._body_of(node.args, node.body)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._body_of(None, node.body)

    def _body_of(self, args: ast.arguments | None, body: list[ast.stmt]) -> None:
        if args is not None:
            for default in (*args.defaults, *args.kw_defaults):
                if default is not None:
                    self.visit(default)
        for stmt in body:
            if not _is_docstring(stmt):
                self.visit(stmt)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None and not _names_dunder_list(node):
            self.edits.append((node, "delete", "pass"))
            self.visit(node.value)

    # --- statements --------------------------------------------------------------------------------
    def visit_Expr(self, node: ast.Expr) -> None:
        if not _is_docstring(node):
            self.edits.append((node, "delete", "pass"))
            self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        if not _names_dunder_list(node):
            self.edits.append((node, "delete", "pass"))
            self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        self.edits.append((node, "delete", "pass"))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.edits.append((node, "delete", "pass"))
        swap = _ARITH_SWAP.get(type(node.op))
        if swap is not None:
            self.edits.append((node, "operator", ast.unparse(ast.AugAssign(node.target, swap(), node.value))))
        self.generic_visit(node)

    def visit_Break(self, node: ast.Break) -> None:
        self.edits.append((node, "loop", "continue"))

    def visit_Continue(self, node: ast.Continue) -> None:
        self.edits.append((node, "loop", "break"))

    # --- expressions -------------------------------------------------------------------------------
    def visit_Compare(self, node: ast.Compare) -> None:
        for i, op in enumerate(node.ops):
            swap = _COMPARE_SWAP.get(type(op))
            if swap is not None:
                ops = [*node.ops[:i], swap(), *node.ops[i + 1 :]]
                self._expr(node, "comparison", ast.Compare(node.left, ops, node.comparators))
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        swap: ast.boolop = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self._expr(node, "boolean", ast.BoolOp(swap, node.values))
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self._expr(node, "boolean", node.operand)
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        swap = _ARITH_SWAP.get(type(node.op))
        if swap is not None:
            self._expr(node, "operator", ast.BinOp(node.left, swap(), node.right))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, bool):
            self.edits.append((node, "constant", repr(not value)))
        elif isinstance(value, int):
            self.edits.append((node, "constant", repr(value + 1)))

    def _expr(self, node: ast.expr, kind: str, new: ast.expr) -> None:
        self.edits.append((node, kind, f"({ast.unparse(new)})"))


def _offsets(source: bytes) -> list[int]:
    starts = [0]
    for i, byte in enumerate(source):
        if byte == 0x0A:
            starts.append(i + 1)
    return starts


def find_mutants(path: str, source: bytes) -> list[Mutant]:
    """Every mutant of ``source`` (the text of ``path``), in order of position then kind (MUT-1, MUT-2)."""
    tree = ast.parse(source)
    lines = source.decode().splitlines()
    starts = _offsets(source)
    finder = _Finder()
    finder.visit(tree)
    found: list[Mutant] = []
    for node, kind, replacement in finder.edits:
        line, end_line = node.lineno, node.end_lineno
        assert end_line is not None and node.end_col_offset is not None
        if any(_NO_MUTATE in lines[i - 1] for i in range(line, end_line + 1)):
            continue
        start, end = starts[line - 1] + node.col_offset, starts[end_line - 1] + node.end_col_offset
        before = source[start:end].decode()
        mutant = Mutant(path, line, kind, _one_line(before), _one_line(replacement), start, end, replacement)
        if _changes_node(node, replacement):
            found.append(mutant)
    found.sort(key=lambda m: (m.start, m.end, m.kind, m.replacement))
    return found


def _changes_node(node: ast.stmt | ast.expr, replacement: str) -> bool:
    """Whether ``replacement`` parses and differs from ``node`` (in place of which it always parses)."""
    try:
        new: ast.AST = ast.parse(replacement).body[0]
    except SyntaxError:
        return False
    if isinstance(node, ast.expr) and isinstance(new, ast.Expr):
        new = new.value
    return ast.dump(new) != ast.dump(node)


def sample(mutants: list[Mutant], n: int | None, seed: int) -> list[Mutant]:
    """``n`` of ``mutants`` (all when ``n`` is None or not smaller), drawn from ``seed`` and the file, in file order."""
    if n is None or n >= len(mutants):
        return list(mutants)
    if not mutants:
        return []
    rng = random.Random(f"{seed}:{mutants[0].path}")
    return [mutants[i] for i in sorted(rng.sample(range(len(mutants)), n))]


def iter_sample(files: dict[str, bytes], n: int | None, seed: int) -> Iterator[Mutant]:
    """The sample of every file, file by file in the given order."""
    for path, source in files.items():
        yield from sample(find_mutants(path, source), n, seed)
