import sys

from steadytrain.warm.server import main

main(sys.argv[1:])
