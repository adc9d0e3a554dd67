"""Image inputs: loading media for requests, chat content parts, processing, encoder cache."""
