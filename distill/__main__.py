from distill.cli import entry

entry()
