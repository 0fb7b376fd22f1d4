"""Chat rows to tokens: the template rendered by jinja2, the cell values it sees, assistant-only labels, each
conversation's head."""
