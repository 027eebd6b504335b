"""One step in the four index spaces: the values (`explanation`), as terminal tables and as SVG/PNG pictures."""
