"""Training data: loading and checking records, and the tokenised preparation cache."""
