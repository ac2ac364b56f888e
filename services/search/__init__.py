"""The search service: a query in, ranked channels out."""
