"""placeholder"""


def add_parser(sub) -> None:
    pass
