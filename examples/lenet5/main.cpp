#include <iostream>
int main() { std::cout << "placeholder\n"; }
