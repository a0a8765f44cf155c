"""Parallelism beyond GSPMD's propagation: context (sequence) parallelism (`context`)."""
