"""The example tool: a calculator the model calls as ``<calc>12*(3+4)</calc>`` and that answers ``<result>84</result>``.

Use it with ``rollout.tool_fn=megatron_opd.tasks.calculator:calculate rollout.tool_stop=</calc>``. The expression is
parsed with ``ast`` and only numbers, + - * / // % ** and parentheses are evaluated: model text is never executed.
"""

from __future__ import annotations

import ast
import operator

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculate(call: str) -> str:
    """The model's turn up to ``</calc>`` -> ``<result>value</result>`` (or ``<result>error</result>``)."""
    start = call.rfind("<calc>")
    end = call.rfind("</calc>")
    expression = call[start + len("<calc>") : end] if start != -1 and end > start else ""
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError):
        return "<result>error</result>"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"<result>{value}</result>"
