"""Training data: documents, mini-batch streams, built-in data, document lengths, outlier delay."""
