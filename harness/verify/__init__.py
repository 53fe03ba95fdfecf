"""Verifying: the checks (`checks`), the one judge (`judge`), golden traces (`golden`), the broken
catalogue's catchers (`detection`), the reproduction command lines (`commands`)."""
