"""The work behind each ``moectl`` verb, as plain functions returning JSON-ready dicts."""
