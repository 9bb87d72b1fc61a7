# Debian's xsimd 8.1 package exports INTERFACE_LINK_LIBRARIES "xtl" without finding xtl, so
# linking fails with -lxtl. xtl is only needed for xsimd's optional complex support, so an empty
# stand-in target is enough. Harmless where xtl exists (the target is then already defined).
if(NOT TARGET xtl)
  add_library(xtl INTERFACE IMPORTED)
endif()
