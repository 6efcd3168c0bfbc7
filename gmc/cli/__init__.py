"""The ``gmc`` command line: thin click commands over the library."""
