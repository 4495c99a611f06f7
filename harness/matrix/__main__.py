from harness.matrix.run import main

main()
