from opengem.cli import main

raise SystemExit(main())
