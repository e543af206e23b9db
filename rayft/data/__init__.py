"""Data: where each split comes from, record → example, tokenizers, and the Ray Data pipeline that feeds the workers."""
