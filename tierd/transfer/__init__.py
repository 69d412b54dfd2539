"""Copy engine: runs, routes between media, prioritised I/O, bandwidth."""
