"""Triton 3.6 (the GPU machine's) passes a jit function's plain-str default to its body unwrapped, so a kernel with
`P: gl.constexpr = "r,r"` compiles on this machine's newer Triton and fails on the GPU ("'str' object has no
attribute 'type'"). Only the source shows it on a CPU: no @jit function in src/qerl/kernels takes a str default."""

import ast
import pathlib

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "src" / "qerl" / "kernels"


def _is_jit(dec: ast.expr) -> bool:
    node = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(node, ast.Attribute) and node.attr == "jit" or isinstance(node, ast.Name) and node.id == "jit"


def str_defaults(source: str) -> list[str]:
    """'function(param)' for every str-literal default of a @...jit function in the source."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef) and any(_is_jit(d) for d in fn.decorator_list):
            args = fn.args.posonlyargs + fn.args.args
            pairs = list(zip(args[len(args) - len(fn.args.defaults):], fn.args.defaults))
            pairs += [(a, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None]
            found += [f"{fn.name}({a.arg})" for a, d in pairs
                      if isinstance(d, ast.Constant) and isinstance(d.value, str)]
    return found


def test_the_check_sees_a_str_default():
    src = '@gluon.jit\ndef f(q, R: gl.constexpr = "r,r", N: gl.constexpr = 4):\n    pass\n'
    assert str_defaults(src) == ["f(R)"]
    assert str_defaults('def g(R="r,r"):\n    pass\n') == []  # not a kernel


def test_no_kernel_takes_a_str_default():
    files = sorted(KERNELS.rglob("*.py"))
    assert files
    bad = [f"{p.relative_to(KERNELS)}: {d}" for p in files for d in str_defaults(p.read_text())]
    assert not bad, bad
