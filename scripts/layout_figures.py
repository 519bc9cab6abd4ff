"""Figures for the layout: code lines per module and the longest functions.

    python scripts/layout_figures.py                 # the core (hdet_jax/*.py)
    python scripts/layout_figures.py hdet_jax/trainer --top 10

A code line is a line that is neither blank, a comment nor part of a docstring. A function's length counts
its code lines, nested functions included (so a closure-heavy factory shows its full size).
"""

import argparse
import ast
import glob
import io
import os
import tokenize


def code_lines(source: str) -> set[int]:
  """Line numbers holding code: not blank, not only a comment, not inside a docstring."""
  tree = ast.parse(source)
  doc_lines = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      body = node.body
      if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0], 'value', None), ast.Constant)
        and isinstance(body[0].value.value, str)
      ):
        doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
  lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type in (
      tokenize.COMMENT,
      tokenize.NL,
      tokenize.NEWLINE,
      tokenize.INDENT,
      tokenize.DEDENT,
      tokenize.ENDMARKER,
    ):
      continue
    lines.update(range(tok.start[0], tok.end[0] + 1))
  return lines - doc_lines


def functions(path: str):
  """(qualified name, code lines) of every function in a file, methods and nested functions included."""
  source = open(path, encoding='utf-8').read()
  code = code_lines(source)
  out = []

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        name = f'{prefix}{child.name}'
        n = len(code & set(range(child.lineno, child.end_lineno + 1)))
        out.append((name, n))
        visit(child, name + '.')
      elif isinstance(child, ast.ClassDef):
        visit(child, f'{prefix}{child.name}.')

  visit(ast.parse(source), '')
  return out, len(code)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('folders', nargs='*', default=['hdet_jax'])
  parser.add_argument('--top', type=int, default=10)
  args = parser.parse_args()
  paths = sorted(p for f in args.folders for p in glob.glob(os.path.join(f, '*.py')))
  rows, funcs = [], []
  for path in paths:
    fs, n = functions(path)
    total = len(open(path, encoding='utf-8').read().splitlines())
    rows.append((path, total, n))
    funcs += [(f'{path}:{name}', k) for name, k in fs]
  print('| module | lines | code lines |\n|---|---:|---:|')
  for path, total, n in rows:
    print(f'| {path} | {total} | {n} |')
  print(f'| all | {sum(r[1] for r in rows)} | {sum(r[2] for r in rows)} |')
  print(f'\nthe {args.top} longest functions (code lines)\n')
  print('| function | code lines |\n|---|---:|')
  for name, k in sorted(funcs, key=lambda x: -x[1])[: args.top]:
    print(f'| {name} | {k} |')
  over = [f for f in funcs if f[1] > 35]
  print(f'\nfunctions over 35 code lines: {len(over)} of {len(funcs)}')


if __name__ == '__main__':
  main()
