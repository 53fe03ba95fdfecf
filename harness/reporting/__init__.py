"""Reporting, a leaf beside the stack: `summary.json` and the console (`report`), `index.html`
(`html`) and its plots (`plots`)."""
