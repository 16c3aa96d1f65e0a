"""What several test files share: each family's input builders and output checks
(``cases/<family>.py``), the argument-error tables and their runner (``arguments.py``), and the
values every sampling op's tests use (``common.py``). Test files import from here, never from
each other."""
