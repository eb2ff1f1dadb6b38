from omniinfer.cli import main

raise SystemExit(main())
