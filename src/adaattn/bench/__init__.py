"""Benchmark suites behind `adaattn bench` (being written)."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(func=lambda args: print("adaattn bench: not built yet") or 1)
