"""Tools as plain typed functions (docs/agents.md):

    steadyrl up --model smollm2-135m-instruct --tools examples/agents/calculator.py:calc --reward numeric_match

The JSON schema each tool is offered with comes from its signature and docstring."""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only + - * / and numbers")


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, with + - * / and parentheses, e.g. "(2 + 3) * 4".
    """
    value = _eval(ast.parse(expression, mode="eval").body)
    return str(int(value) if float(value).is_integer() else value)
