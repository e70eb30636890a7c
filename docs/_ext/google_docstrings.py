"""A docutils parser that lets sphinx-autodoc2 render Google-style docstrings.

autodoc2 parses docstrings with a docutils parser named in ``autodoc2_docstring_parser_regexes``.
Google-style sections (``Args:``, ``Returns:``, ``Raises:``) are not reStructuredText, so this
parser first rewrites the docstring with Sphinx's napoleon converter and then hands the result
to the standard reStructuredText parser.
"""

from __future__ import annotations

from docutils import nodes
from docutils.parsers import rst
from sphinx.ext.napoleon import Config
from sphinx.ext.napoleon.docstring import GoogleDocstring

_NAPOLEON_CONFIG = Config(
    napoleon_use_param=True,
    napoleon_use_rtype=True,
    napoleon_use_ivar=True,
    napoleon_attr_annotations=True,
)


def google_to_rst(text: str) -> str:
    """Convert a Google-style docstring to reStructuredText.

    Args:
        text: The docstring, already dedented.

    Returns:
        The reStructuredText napoleon produces for it.
    """
    return str(GoogleDocstring(text, _NAPOLEON_CONFIG))


class Parser(rst.Parser):
    """reStructuredText parser that accepts Google-style docstrings."""

    supported = ("google",)

    def parse(self, inputstring: str, document: nodes.document) -> None:
        """Convert ``inputstring`` from Google style and parse it into ``document``."""
        super().parse(google_to_rst(inputstring), document)
