"""Writing a benchmark's section of a results page."""

import pathlib
import re


def replace_section(path, heading: str, lines: list[str]) -> None:
  """Replaces the section of ``path`` that starts at ``heading`` (up to the next ``## `` heading) with ``lines``
  (which start with it), or appends them at the end."""
  text = pathlib.Path(path).read_text()
  new = '\n'.join(lines)
  if heading in text:
    before, after = text.split(heading, 1)
    rest = re.search(r'^## ', after, re.M)
    text = before + new + ('\n' + after[rest.start() :] if rest else '')
  else:
    text = text.rstrip('\n') + '\n\n' + new
  pathlib.Path(path).write_text(text.rstrip('\n') + '\n')
